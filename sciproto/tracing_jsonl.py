"""A span exporter that appends finished spans to a JSON Lines file.

One span per line, so spans of the processes of one episode (rollout client,
env server, policy server) can be joined on `trace_id` with nothing but a text
tool, and read back in tests without a collector:

    {"trace_id": "32 hex", "span_id": "16 hex", "parent_span_id": "16 hex" | null,
     "name": "/sciproto.v1.EnvironmentService/Step", "kind": "SERVER",
     "start_time_unix_nano": 1700000000000000000, "end_time_unix_nano": ...,
     "attributes": {...}, "status": {"code": "UNSET" | "OK" | "ERROR", "description": ""},
     "events": [{"name": "exception", "time_unix_nano": ..., "attributes": {...}}],
     "service_name": "sciproto-env"}

Each exported batch is written with a single `write` on a file opened for
appending, so processes that share one file interleave whole batches, never
half lines.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.resources import SERVICE_NAME
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult


def span_to_record(span: ReadableSpan) -> dict[str, Any]:
    """The JSON object written for one finished span."""
    context = span.get_span_context()
    assert context is not None, "a finished SDK span always has a span context"
    return {
        "trace_id": f"{context.trace_id:032x}",
        "span_id": f"{context.span_id:016x}",
        "parent_span_id": f"{span.parent.span_id:016x}" if span.parent is not None else None,
        "name": span.name,
        "kind": span.kind.name,
        "start_time_unix_nano": span.start_time,
        "end_time_unix_nano": span.end_time,
        "attributes": _plain(span.attributes),
        "status": {"code": span.status.status_code.name, "description": span.status.description or ""},
        "events": [
            {"name": event.name, "time_unix_nano": event.timestamp, "attributes": _plain(event.attributes)}
            for event in span.events
        ],
        "service_name": span.resource.attributes.get(SERVICE_NAME, ""),
    }


def _plain(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    # OTel keeps sequence attributes as tuples; JSON wants lists.
    return {key: list(value) if isinstance(value, tuple) else value for key, value in (attributes or {}).items()}


class JsonlSpanExporter(SpanExporter):
    """Appends spans to `path` (created with its folder if missing)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(span_to_record(span), ensure_ascii=False) + "\n" for span in spans)
        with self._lock:
            if self._file.closed:
                return SpanExportResult.FAILURE
            self._file.write(lines)
            self._file.flush()
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        with self._lock:
            if not self._file.closed:
                self._file.flush()
        return True

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()


def read_spans(path: Path) -> list[dict[str, Any]]:
    """Every span record in a file written by JsonlSpanExporter."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
