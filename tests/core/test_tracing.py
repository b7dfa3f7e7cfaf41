"""Trace context crosses a real process boundary, through gRPC metadata and
through the requests' `trace_context` field, and costs nothing when off.

The test process is the client (its spans go to one JSONL file); a
tracing probe server process writes its spans to another. Each call runs under
a parent span opened here; the assertions join both files on span ids.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes

from sciproto import pb
from sciproto.channel import make_channel
from sciproto.processes import ServerProcess, start_command
from sciproto.tracing import (
    Attr,
    Operation,
    TracingConfig,
    client_interceptors,
    current_trace_context,
    extract_context,
    flush_tracing,
    inject_metadata,
    server_interceptors,
    setup_tracing,
    shutdown_tracing,
    start_span,
)
from sciproto.tracing_jsonl import read_spans

PROBE = Path(__file__).with_name("tracing_probe_server.py")
STEP_RPC = f"/{pb.ENV_SERVICE}/Step"
SESSION_RPC = f"/{pb.ENV_SERVICE}/Session"


def start_probe(exporter: str, jsonl_path: Path) -> ServerProcess:
    return start_command([sys.executable, str(PROBE), exporter, str(jsonl_path)], timeout_s=60)


@dataclass
class TracedRun:
    """Spans of both processes, and the span id of the parent opened for each call."""

    client: list[dict[str, Any]]
    server: list[dict[str, Any]]
    parents: dict[str, str]  # episode id -> span id of its parent span in the test process
    answers: dict[str, dict[str, str]]  # episode id -> StepResponse.info

    def client_span(self, span_id: str) -> dict[str, Any]:
        return next(span for span in self.client if span["span_id"] == span_id)

    def server_spans(self, name: str) -> list[dict[str, Any]]:
        return [span for span in self.server if span["name"] == name]

    def step_span(self, episode_id: str) -> dict[str, Any]:
        (span,) = [s for s in self.server_spans(Operation.ENV_STEP) if s["attributes"][Attr.EPISODE_ID] == episode_id]
        return span

    def server_span(self, span_id: str) -> dict[str, Any]:
        return next(span for span in self.server if span["span_id"] == span_id)


def span_id_of(span: Any) -> str:
    return f"{span.get_span_context().span_id:016x}"


async def call_step(stub: Any, episode_id: str, *, field: bool, metadata: bool) -> tuple[str, dict[str, str]]:
    """One Step under a parent span of its own, the context sent as asked."""
    with start_span(f"test.parent.{episode_id}") as parent:
        request = pb.env_pb2.StepRequest(episode_id=episode_id, trace_context=current_trace_context() if field else None)
        response = await stub.Step(request, metadata=inject_metadata() if metadata else None, timeout=30)
    return span_id_of(parent), dict(response.info)


async def make_calls(target: str, tracing: TracingConfig) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    calls: dict[str, tuple[str, dict[str, str]]] = {}
    async with make_channel(target) as channel:
        stub = pb.env_grpc.EnvironmentServiceStub(channel)
        # metadata only, as a caller without interceptors would send it; then the request field only
        calls["metadata"] = await call_step(stub, "metadata", field=False, metadata=True)
        calls["field"] = await call_step(stub, "field", field=True, metadata=False)
        # one stream, two episodes, each step under its own episode's parent span
        session = stub.Session(timeout=30)
        for episode_id in ("session-a", "session-b"):
            with start_span(f"test.parent.{episode_id}") as parent:
                step = pb.env_pb2.StepRequest(request_id=episode_id, episode_id=episode_id,
                                              trace_context=current_trace_context())
                await session.write(pb.env_pb2.SessionRequest(step=step))
                calls[episode_id] = span_id_of(parent), dict((await session.read()).step.info)
        await session.done_writing()
        assert await session.read() is grpc.aio.EOF
    # the client interceptor sends the metadata itself, under a CLIENT span
    async with make_channel(target, interceptors=client_interceptors(tracing)) as channel:
        stub = pb.env_grpc.EnvironmentServiceStub(channel)
        calls["interceptor"] = await call_step(stub, "interceptor", field=True, metadata=False)
    return {key: parent for key, (parent, _) in calls.items()}, {key: info for key, (_, info) in calls.items()}


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> TracedRun:
    folder = tmp_path_factory.mktemp("traces")
    tracing = TracingConfig(exporter="jsonl", jsonl_path=folder / "client.jsonl")
    setup_tracing(tracing, "test-client")
    server = start_probe("jsonl", folder / "server.jsonl")
    try:
        parents, answers = asyncio.run(make_calls(server.target, tracing))
    finally:
        assert server.stop() == 0, "\n".join(server.output)  # the server flushes its spans on shutdown
        flush_tracing()
        shutdown_tracing()
    return TracedRun(read_spans(folder / "client.jsonl"), read_spans(folder / "server.jsonl"), parents, answers)


def test_metadata_makes_the_rpc_span_a_child_of_the_callers_span(traced: TracedRun) -> None:
    parent = traced.client_span(traced.parents["metadata"])
    step = traced.step_span("metadata")
    rpc = traced.server_span(step["parent_span_id"])
    assert (rpc["name"], rpc["kind"]) == (STEP_RPC, "SERVER")
    assert rpc["parent_span_id"] == parent["span_id"]
    assert rpc["trace_id"] == step["trace_id"] == parent["trace_id"] == traced.answers["metadata"]["trace_id"]
    assert step["service_name"] == "tracing-probe" and parent["service_name"] == "test-client"
    assert traced.answers["metadata"]["recording"] == "True"


def test_request_field_alone_carries_the_trace(traced: TracedRun) -> None:
    parent = traced.client_span(traced.parents["field"])
    step = traced.step_span("field")
    assert step["parent_span_id"] == parent["span_id"]
    assert step["trace_id"] == parent["trace_id"]
    assert step["kind"] == "SERVER"
    # without metadata the RPC span starts a trace of its own; the step leaves it for the caller's
    (rpc,) = [s for s in traced.server_spans(STEP_RPC) if s["start_time_unix_nano"] <= step["start_time_unix_nano"]
              and s["end_time_unix_nano"] >= step["end_time_unix_nano"] and s["trace_id"] != parent["trace_id"]]
    assert rpc["parent_span_id"] is None


def test_each_step_on_one_stream_joins_its_own_episodes_trace(traced: TracedRun) -> None:
    (session,) = traced.server_spans(SESSION_RPC)
    steps = [traced.step_span(episode_id) for episode_id in ("session-a", "session-b")]
    parents = [traced.client_span(traced.parents[episode_id]) for episode_id in ("session-a", "session-b")]
    for step, parent in zip(steps, parents):
        assert step["parent_span_id"] == parent["span_id"]
        assert step["trace_id"] == parent["trace_id"]
    assert steps[0]["trace_id"] != steps[1]["trace_id"] != session["trace_id"]


def test_client_interceptor_nests_client_server_and_step_spans(traced: TracedRun) -> None:
    parent = traced.client_span(traced.parents["interceptor"])
    (client_rpc,) = [s for s in traced.client if s["parent_span_id"] == parent["span_id"]]
    assert (client_rpc["name"], client_rpc["kind"]) == (STEP_RPC, "CLIENT")
    step = traced.step_span("interceptor")
    server_rpc = traced.server_span(step["parent_span_id"])
    assert server_rpc["parent_span_id"] == client_rpc["span_id"]
    # the request field names the caller's span: the step still nests under the RPC, in the same trace
    assert step["kind"] == "INTERNAL"
    assert {parent["trace_id"], client_rpc["trace_id"], server_rpc["trace_id"], step["trace_id"]} == {parent["trace_id"]}


def test_tracing_off_installs_nothing_and_writes_nothing(tmp_path: Path) -> None:
    off = TracingConfig()
    assert server_interceptors(off) == [] and client_interceptors(off) == []
    assert inject_metadata() == () and current_trace_context() == pb.common_pb2.TraceContext()
    with start_span("not recorded") as span:
        assert not span.is_recording()
    path = tmp_path / "spans.jsonl"
    server = start_probe("none", path)
    try:
        answers = asyncio.run(_step_with_context(server.target))
    finally:
        assert server.stop() == 0
    assert answers == {"trace_id": "", "recording": "False"}
    assert not path.exists()


async def _step_with_context(target: str) -> dict[str, str]:
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    request = pb.env_pb2.StepRequest(episode_id="off", trace_context=pb.common_pb2.TraceContext(traceparent=traceparent))
    async with make_channel(target) as channel:
        response = await pb.env_grpc.EnvironmentServiceStub(channel).Step(
            request, metadata=(("traceparent", traceparent),), timeout=30)
    return dict(response.info)


def test_extract_context_prefers_metadata_and_ignores_malformed_values() -> None:
    from opentelemetry import trace

    def trace_id(context: Any) -> str:
        span_context = trace.get_current_span(context).get_span_context()
        return f"{span_context.trace_id:032x}" if span_context.is_valid else ""

    in_metadata = "00-11111111111111111111111111111111-2222222222222222-01"
    in_field = pb.common_pb2.TraceContext(traceparent="00-33333333333333333333333333333333-4444444444444444-01")
    assert trace_id(extract_context([("traceparent", in_metadata)], in_field)) == "1" * 32
    assert trace_id(extract_context([("traceparent", "garbage")], in_field)) == "3" * 32
    assert trace_id(extract_context(None, in_field)) == "3" * 32
    assert trace_id(extract_context((), pb.common_pb2.TraceContext())) == ""


def test_config_errors_say_what_to_set() -> None:
    with pytest.raises(ValueError, match="tracing.jsonl_path"):
        TracingConfig(exporter="jsonl")
    with pytest.raises(ValueError, match="exportr"):
        TracingConfig.model_validate({"exportr": "jsonl"})
    with pytest.raises(RuntimeError, match="setup_tracing"):
        server_interceptors(TracingConfig(exporter="console"))


def test_attribute_names_match_the_genai_semantic_conventions() -> None:
    ours = {name: value for name, value in vars(Attr).items() if name.startswith("GEN_AI_")}
    assert ours and all(getattr(gen_ai_attributes, name) == value for name, value in ours.items())
    operations = {value.value for value in gen_ai_attributes.GenAiOperationNameValues}
    assert {Operation.CHAT, Operation.EXECUTE_TOOL, Operation.INVOKE_AGENT} <= operations
