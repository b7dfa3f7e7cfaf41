"""One trace per episode across three processes: an env server, a policy server and
`sciproto collect`, each exporting its spans to its own JSONL file. The spans are joined on
trace and span ids: the client's episode span holds the reset, chat, step, verify and close
spans; each server's spans hang under the client's call that caused them."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sciproto import pb
from sciproto.client.rollouts import RolloutRecord, read_rollouts
from sciproto.processes import ServerProcess, sciproto_command, start_server
from sciproto.tracing import Attr, Operation, span_name
from sciproto.tracing_jsonl import read_spans

TASKS = 3
Span = dict[str, Any]


def tracing_to(path: Path) -> list[str]:
    return ["--set", "tracing.exporter=jsonl", "--set", f"tracing.jsonl_path={path}"]


@dataclass
class Run:
    rollouts: list[RolloutRecord]
    client: list[Span]
    env: list[Span]
    policy: list[Span]

    def by_id(self) -> dict[str, Span]:
        return {span["span_id"]: span for span in [*self.client, *self.env, *self.policy]}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    folder = tmp_path_factory.mktemp("traces")
    servers: list[ServerProcess] = []
    try:
        env = start_server(["serve", "env", "--env", "toy", "--port", "0", *tracing_to(folder / "env.jsonl")],
                           log_file=folder / "env.log")
        servers.append(env)
        policy = start_server(["serve", "policy", "--model", "tiny", "--port", "0",
                               *tracing_to(folder / "policy.jsonl")], log_file=folder / "policy.log")
        servers.append(policy)
        output = folder / "rollouts.jsonl"
        collect = subprocess.run(
            sciproto_command("collect", "--env", env.target, "--policy", policy.target, "--tasks", "toy:test",
                             "--output", str(output), "--limit", str(TASKS), "--concurrency", str(TASKS),
                             "--set", "sampling.max_tokens=8", "--set", "progress=false",
                             *tracing_to(folder / "client.jsonl")),
            check=False, capture_output=True, text=True, timeout=300)
        assert collect.returncode == 0, collect.stderr[-3000:]
    finally:
        for server in servers:
            server.stop()  # SIGTERM: the server flushes its spans on the way out
    yield Run(list(read_rollouts(output)), read_spans(folder / "client.jsonl"), read_spans(folder / "env.jsonl"),
              read_spans(folder / "policy.jsonl"))


def in_trace(spans: list[Span], trace_id: str) -> list[Span]:
    return [span for span in spans if span["trace_id"] == trace_id]


def children(spans: list[Span], parent: Span) -> list[Span]:
    return [span for span in spans if span["parent_span_id"] == parent["span_id"]]


def only(spans: list[Span]) -> Span:
    assert len(spans) == 1, [span["name"] for span in spans]
    return spans[0]


def test_every_episode_is_one_trace_rooted_in_the_clients_episode_span(run: Run) -> None:
    assert len(run.rollouts) == TASKS
    trace_ids = {rollout.trace_id for rollout in run.rollouts}
    assert len(trace_ids) == TASKS and all(len(trace_id) == 32 for trace_id in trace_ids)
    for rollout in run.rollouts:
        spans = in_trace([*run.client, *run.env, *run.policy], rollout.trace_id)
        root = only([span for span in spans if span["parent_span_id"] is None])
        assert root["name"] == span_name(Operation.INVOKE_AGENT, "toy") and root["service_name"] == "sciproto-rollout"
        assert root["attributes"][Attr.ENV_NAME] == "toy"
        assert root["attributes"][Attr.TASK_ID] == rollout.group_id
        assert root["attributes"][Attr.SAMPLE_INDEX] == rollout.sample
        assert root["attributes"][Attr.REWARD_VALUE] == pytest.approx(rollout.reward)
        assert root["attributes"][Attr.GEN_AI_USAGE_OUTPUT_TOKENS] == rollout.tokens.completion
        assert root["attributes"][Attr.POLICY_VERSION] == rollout.policy_version.max == 0
        steps = [span["name"] for span in children(run.client, root)]
        assert steps == [span_name(Operation.ENV_RESET, "toy"), span_name(Operation.CHAT),
                         span_name(Operation.ENV_STEP, "toy"), span_name(Operation.ENV_VERIFY, "toy"),
                         span_name(Operation.ENV_CLOSE, "toy")], "in the order they ran"
        # Every span of the three files belongs to one episode's trace, or to calls made outside
        # any episode (the split size the collection asks first).
        assert {span["service_name"] for span in spans} == {"sciproto-rollout", "sciproto-env", "sciproto-policy"}


def server_rpc_spans(spans: list[Span]) -> list[Span]:
    return [span for span in spans if span["kind"] == "SERVER" and span["name"].startswith("/sciproto.v1.")]


def test_server_spans_are_children_of_the_clients_calls(run: Run) -> None:
    """Policy calls are RPCs: the client's CLIENT span, the server's RPC span under it. Env
    operations travel on EnvClient's shared Session stream: each server-side operation span
    hangs directly under the agent's span for it, named by the request's trace_context, and the
    stream's own RPC span is in a trace of its own, outside every episode."""
    by_id = run.by_id()
    client_ids = {span["span_id"] for span in run.client}
    episode_traces = {rollout.trace_id for rollout in run.rollouts}
    episode_rpcs = [span for span in server_rpc_spans([*run.env, *run.policy]) if span["trace_id"] in episode_traces]
    assert {span["name"] for span in episode_rpcs} == {f"/{pb.POLICY_SERVICE}/Generate"}
    env_operations = [span for span in run.env if span["trace_id"] in episode_traces]
    assert {span["name"].split()[0] for span in env_operations} == {
        f"sciproto.env.{operation}" for operation in ("reset", "step", "verify", "close")}
    for operation in env_operations:
        assert operation["kind"] == "SERVER" and operation["parent_span_id"] in client_ids
        agent = by_id[operation["parent_span_id"]]
        assert agent["service_name"] == "sciproto-rollout" and agent["name"] == operation["name"]
        assert agent["trace_id"] == operation["trace_id"]
    streams = [span for span in server_rpc_spans(run.env) if span["name"] == f"/{pb.ENV_SERVICE}/Session"]
    assert streams and not {span["trace_id"] for span in streams} & episode_traces
    for rpc in episode_rpcs:
        assert rpc["parent_span_id"] in client_ids, f"{rpc['name']}: its parent is in the client's file"
        call = by_id[rpc["parent_span_id"]]
        assert call["kind"] == "CLIENT" and call["name"] == rpc["name"] and call["trace_id"] == rpc["trace_id"]
        operation = by_id[call["parent_span_id"]]  # the agent's span for the operation
        assert operation["service_name"] == "sciproto-rollout"
        assert operation["name"].split()[0] == (Operation.CHAT if "Policy" in rpc["name"] else
                                                 f"sciproto.env.{rpc['name'].rsplit('/', 1)[1].lower()}")


def test_env_server_spans_carry_env_episode_and_reward(run: Run) -> None:
    for rollout in run.rollouts:
        env_spans = in_trace(run.env, rollout.trace_id)
        by_name = {span["name"]: span for span in env_spans}
        reset = by_name[span_name(Operation.ENV_RESET, "toy")]
        step = by_name[span_name(Operation.ENV_STEP, "toy")]
        verify = by_name[span_name(Operation.ENV_VERIFY, "toy")]
        close = by_name[span_name(Operation.ENV_CLOSE, "toy")]
        assert reset["attributes"][Attr.TASK_ID] == rollout.group_id
        episode_id = reset["attributes"][Attr.EPISODE_ID]
        for span in (reset, step, verify, close):
            assert span["attributes"][Attr.ENV_NAME] == "toy"
            assert span["attributes"][Attr.EPISODE_ID] == episode_id
            agent = only([client for client in run.client if client["span_id"] == span["parent_span_id"]])
            assert agent["name"] == span["name"], "under the agent's span for the operation"
        assert step["attributes"][Attr.REWARD_VALUE] == pytest.approx(rollout.reward)
        assert verify["attributes"][Attr.REWARD_VALUE] == pytest.approx(rollout.reward)
        assert verify["attributes"][Attr.REWARD_STATUS] == rollout.status.value == "SCORED"


def test_policy_server_spans_carry_model_tokens_version_and_finish_reasons(run: Run) -> None:
    for rollout in run.rollouts:
        chat = only([span for span in in_trace(run.policy, rollout.trace_id)
                     if span["name"].startswith(f"{Operation.CHAT} ")])
        attributes = chat["attributes"]
        assert attributes[Attr.GEN_AI_OPERATION_NAME] == Operation.CHAT
        assert attributes[Attr.GEN_AI_REQUEST_MODEL].startswith("tiny")  # the loaded model's name
        assert chat["name"] == span_name(Operation.CHAT, attributes[Attr.GEN_AI_REQUEST_MODEL])
        assert chat["parent_span_id"] == only(server_rpc_spans(in_trace(run.policy, rollout.trace_id)))["span_id"]
        assert attributes[Attr.GEN_AI_USAGE_INPUT_TOKENS] == rollout.tokens.prompt
        assert attributes[Attr.GEN_AI_USAGE_OUTPUT_TOKENS] == rollout.tokens.completion
        assert attributes[Attr.POLICY_VERSION] == 0
        assert attributes[Attr.GEN_AI_RESPONSE_FINISH_REASONS] in (["stop"], ["length"])
