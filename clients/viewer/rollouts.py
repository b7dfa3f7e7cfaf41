"""Rollout files as the viewer reads them: a summary row per line for the
table, and the whole record of one line on demand.

A file is read incrementally and only up to its last complete line, so a file
that `sciproto collect` is still appending to can be viewed and refreshed.
The failures file beside it is rewritten on every run; a changed beginning
tells the reader to start over.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Per-token arrays are as long as the trajectory: the transcript view shows
# their lengths, the table never needs them.
TOKEN_ARRAYS = ("token_ids", "loss_mask", "logprobs")
TASK_TEXT_CHARS = 300
HEAD_BYTES = 256  # a file whose first bytes changed was rewritten


def failures_path_for(path: Path) -> Path:
    """`out.jsonl` -> `out.failures.jsonl`, where `sciproto collect` writes INFRA_ERROR rollouts."""
    return path.with_name(f"{path.stem}.failures{path.suffix or '.jsonl'}")


def finite(value: Any) -> Any:
    """`value` with NaN and infinities as None: JSON.parse in a browser refuses them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [finite(item) for item in value]
    return value


def task_text(task: Any) -> str:
    """One line for the table: the task's question, or all its fields."""
    if not isinstance(task, dict):
        return "" if task is None else str(task)
    text = task.get("question") or " · ".join(f"{key}: {value}" for key, value in task.items())
    text = " ".join(str(text).split())
    return text if len(text) <= TASK_TEXT_CHARS else text[: TASK_TEXT_CHARS - 1] + "…"


def reward_of(record: dict[str, Any]) -> float | None:
    """The reward to show and count, or None. An INFRA_ERROR rollout's reward is
    a placeholder (the environment failed): counting it would read a failure as
    a wrong answer."""
    reward = record.get("reward")
    if record.get("status") == "INFRA_ERROR" or isinstance(reward, bool) or not isinstance(reward, (int, float)):
        return None
    return reward


def summarize(record: dict[str, Any], key: str) -> dict[str, Any]:
    """The table row of one rollout."""
    tokens = record.get("tokens") or {}
    prompt, completion = int(tokens.get("prompt") or 0), int(tokens.get("completion") or 0)
    tool_names = sorted({call.get("name", "") for message in record.get("messages") or []
                         for call in message.get("tool_calls") or [] if isinstance(call, dict)} - {""})
    return finite({
        "key": key,
        "rollout_id": record.get("rollout_id", ""),
        "env": record.get("env", ""),
        "split": record.get("split", ""),
        "index": record.get("index"),
        "sample": record.get("sample"),
        "status": record.get("status", ""),
        "reward": reward_of(record),
        "steps": record.get("steps"),
        "tokens": prompt + completion,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "seconds": record.get("seconds"),
        "task": task_text(record.get("task")),
        "tools": tool_names,
        "error": record.get("error") or "",
        "finished_at": record.get("finished_at", ""),
    })


def for_transcript(record: dict[str, Any]) -> dict[str, Any]:
    """The whole record, with per-token arrays replaced by their lengths."""
    shown = {key: value for key, value in record.items() if key not in TOKEN_ARRAYS}
    shown["token_counts"] = {name: len(record.get(name) or []) for name in TOKEN_ARRAYS}
    shown["reward"] = reward_of(record)
    return finite(shown)


@dataclass
class RolloutFile:
    """One JSONL file of rollouts, indexed by line."""

    source: str  # "rollouts" or "failures": the key prefix of its rows
    path: Path
    offsets: list[int] = field(default_factory=list)  # byte offset of each line read so far
    rows: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    _read_to: int = 0
    _head: bytes = b""

    def refresh(self) -> None:
        """Read lines appended since the last call; start over if the file was rewritten."""
        if not self.path.exists():
            self._forget()
            return
        with self.path.open("rb") as stream:
            head = stream.read(HEAD_BYTES)
            if not head.startswith(self._head):  # rewritten or truncated, not appended to
                self._forget()
            self._head = head
            stream.seek(self._read_to)
            for raw in stream:
                if not raw.endswith(b"\n"):
                    break  # a line still being written waits for the next refresh
                self._add(raw, self._read_to)
                self._read_to += len(raw)

    def _forget(self) -> None:
        self.offsets, self.rows, self.problems, self._read_to, self._head = [], [], [], 0, b""

    def _add(self, raw: bytes, offset: int) -> None:
        line_number = len(self.offsets) + 1
        self.offsets.append(offset)
        if not raw.strip():
            return
        try:
            record = json.loads(raw)
        except ValueError as error:
            self.problems.append(f"{self.path.name} line {line_number}: not JSON ({error})")
            return
        if not isinstance(record, dict):
            self.problems.append(f"{self.path.name} line {line_number}: a JSON {type(record).__name__}, not an object")
            return
        self.rows.append(summarize(record, f"{self.source}:{line_number}"))

    def record(self, line_number: int) -> dict[str, Any]:
        if not 1 <= line_number <= len(self.offsets):
            raise KeyError(f"{self.path.name} has no line {line_number} (it has {len(self.offsets)})")
        with self.path.open("rb") as stream:
            stream.seek(self.offsets[line_number - 1])
            return json.loads(stream.readline())


class RolloutIndex:
    """A rollouts file and, when it exists, its failures file."""

    def __init__(self, path: Path) -> None:
        path = Path(path)
        self.files = {"rollouts": RolloutFile("rollouts", path)}
        if not path.name.endswith(".failures.jsonl"):
            self.files["failures"] = RolloutFile("failures", failures_path_for(path))
        self._lock = threading.Lock()
        self._rows: list[dict[str, Any]] = []

    def refresh(self) -> None:
        with self._lock:
            for rollout_file in self.files.values():
                rollout_file.refresh()
            self._rows = [row for rollout_file in self.files.values() for row in rollout_file.rows]

    def summary(self) -> dict[str, Any]:
        with self._lock:
            return {
                "files": {source: {"path": str(f.path), "exists": f.path.exists(), "rows": len(f.rows)}
                          for source, f in self.files.items()},
                "total": len(self._rows),
                "problems": [problem for f in self.files.values() for problem in f.problems],
            }

    def page(self, offset: int, limit: int) -> dict[str, Any]:
        """Rows offset..offset+limit, and where the next page starts (None at the end)."""
        with self._lock:
            rows = self._rows[offset: offset + limit]
            end = offset + len(rows)
            return {"rows": rows, "total": len(self._rows), "next_offset": end if end < len(self._rows) else None}

    def record(self, key: str) -> dict[str, Any]:
        """The transcript record of the row `key` ("rollouts:12")."""
        source, _, line = key.partition(":")
        if source not in self.files or not line.isdigit():
            raise KeyError(f"no row {key!r}: keys look like 'rollouts:12' or 'failures:3'")
        with self._lock:
            return for_transcript(self.files[source].record(int(line)))
