"""Fuzzing every service on real server processes: thousands of random, near-valid and mutated
requests. Every answer must be a status the contract documents for bad input (never INTERNAL or
UNKNOWN), the servers must stay up and serving, and their live counters must come back to zero.

Counts of requests sent and statuses seen are printed (pytest -s) and written to
.test-artifacts/fuzz_counts.json.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from proto_strategies import (
    INT_EDGES,
    UINT_EDGES,
    message_strategy,
    mutations,
    texts,
    tool_arguments,
)
from reliability_servers import RECEIVE_LIMIT_BYTES, Tally, health_status

from sciproto import errors
from sciproto.client.policy import distinct_tensors
from sciproto.models import load_model
from sciproto.pb import (
    common_pb2,
    env_grpc,
    env_pb2,
    learner_grpc,
    learner_pb2,
    policy_grpc,
    policy_pb2,
)
from sciproto.processes import ServerProcess
from sciproto.weights.wire import chunk_parts, data_message_wire, header_for

pytestmark = pytest.mark.timeout(600)

Code = grpc.StatusCode
# What the contract lets a server answer to bad input; the test's own early exits (leaving a
# Generate stream) show up as CANCELLED and are counted apart.
DOCUMENTED = {Code.OK, Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.FAILED_PRECONDITION,
              Code.RESOURCE_EXHAUSTED, Code.OUT_OF_RANGE, Code.UNIMPLEMENTED}
CALL_TIMEOUT_S = 60.0
GENERATE_EVENTS_READ = 4  # then the stream is left: the server must stop sampling for it
UNLIMITED = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]

# No shrinking: the servers keep state (episodes, versions), so a failure seldom replays exactly;
# the first failing request is the report.
BASE = settings(deadline=None, derandomize=True, database=None, print_blob=True,
                phases=[Phase.explicit, Phase.generate], report_multiple_bugs=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.large_base_example, HealthCheck.filter_too_much])

# Episode ids the fuzz may address: recent live ones (filled as Resets succeed) and made-up ones.
EPISODES: deque[str] = deque(maxlen=32)
OPENED: set[str] = set()


def episode_ids() -> st.SearchStrategy[str]:
    recent = st.integers(0, 10**6).map(lambda i: EPISODES[i % len(EPISODES)] if EPISODES else "")
    return st.one_of(recent, recent, texts())


def steered(*choices: Any, other: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly one of `choices`, sometimes anything `other` draws."""
    return st.one_of(st.sampled_from(choices), st.sampled_from(choices), other)


ENV_HINTS = {
    "sciproto.v1.ResetRequest.env": steered("toy", "gsm8k", other=texts()),
    "sciproto.v1.StoredTrajectory.env": steered("toy", "gsm8k", other=texts()),
    "sciproto.v1.TaskRef.split": steered("train", "test", other=texts()),
    "sciproto.v1.TaskRef.index": steered(0, 1, 59, 60, 63, 64, 511, 512, 2**32 - 1, other=st.integers(0, 2**32 - 1)),
    "sciproto.v1.InlineTask.fields": st.dictionaries(steered("question", "answer", other=texts()), texts(), max_size=3),
    "sciproto.v1.StepRequest.episode_id": episode_ids(),
    "sciproto.v1.VerifyRequest.episode_id": episode_ids(),
    "sciproto.v1.CloseRequest.episode_id": episode_ids(),
    "sciproto.v1.ChatMessage.role": steered(common_pb2.ROLE_ASSISTANT, other=st.integers(-3, 9)),
    "sciproto.v1.ToolCall.name": steered("calculator", "submit_answer", "", other=texts()),
    "sciproto.v1.ToolCall.id": steered("call_1", "call_2", "", other=texts()),
    "sciproto.v1.ToolCall.arguments": tool_arguments(),
}
POLICY_HINTS = {
    "sciproto.v1.GenerateRequest.n": steered(0, 1, 2, 3, 64, 65, 2**32 - 1, other=st.integers(0, 2**32 - 1)),
    "sciproto.v1.SamplingParams.max_tokens": steered(0, 1, 4, 16, 2**32 - 1, other=st.integers(0, 2**32 - 1)),
    "sciproto.v1.SamplingParams.temperature": steered(0.0, 0.7, 1.0, -1.0, float("nan"), float("inf"),
                                                      other=st.floats()),
    "sciproto.v1.SamplingParams.top_p": steered(0.0, 0.5, 1.0, 1.5, float("nan"), float("-inf"), other=st.floats()),
    "sciproto.v1.TokenPrompt.token_ids": steered(0, 1, 255, 261, 262, 2**32 - 1, other=st.integers(0, 2**32 - 1)),
    "sciproto.v1.ChatPrompt.previous_token_ids": steered(0, 10, 261, 262, 2**32 - 1, other=st.integers(0, 2**32 - 1)),
    "sciproto.v1.ChatMessage.role": steered(1, 2, 3, 4, other=st.integers(-3, 9)),
    "sciproto.v1.ToolCall.arguments": tool_arguments(),
    "sciproto.v1.ToolSpec.parameters_json_schema": steered(
        '{"type": "object"}', "{", "[]", "null", '{"type": "object", "properties": {"x": {"type": "string"}}}',
        other=texts()),
}


def status_of(call: Callable[[], Any]) -> tuple[Code, Any]:
    try:
        return Code.OK, call()
    except grpc.RpcError as error:
        return error.code(), error


def check(tally: Tally, service: str, code: Code, answer: Any, requests: int = 1, allowed: Iterable[Code] = DOCUMENTED) -> None:
    tally.saw(service, code.name, requests)
    assert code in set(allowed), f"{service} answered {code.name}: {answer}"


def check_in_band(tally: Tally, service: str, status: Any) -> None:
    code = errors.from_status(status).code
    tally.saw(f"{service} (in-band)", code.name, requests=0)
    assert code in DOCUMENTED, f"{service} answered in band {code.name}: {status.message}"


# ---------------------------------------------------------------- setup


@pytest.fixture(scope="module")
def channels(fuzzed_servers: dict[str, ServerProcess]) -> Iterator[dict[str, grpc.Channel]]:
    opened = {name: grpc.insecure_channel(server.target, options=UNLIMITED) for name, server in fuzzed_servers.items()}
    yield opened
    for channel in opened.values():
        channel.close()


@pytest.fixture(scope="module")
def env_stub(channels: dict[str, grpc.Channel]) -> env_grpc.EnvironmentServiceStub:
    stub = env_grpc.EnvironmentServiceStub(channels["env"])
    for env, split in (("toy", "train"), ("gsm8k", "test"), ("gsm8k", "train")):
        for index in range(3):
            reset = stub.Reset(env_pb2.ResetRequest(env=env, task_ref=env_pb2.TaskRef(split=split, index=index)),
                               timeout=CALL_TIMEOUT_S)
            EPISODES.append(reset.episode_id)
            OPENED.add(reset.episode_id)
    return stub


@pytest.fixture(scope="module")
def policy_stub(channels: dict[str, grpc.Channel]) -> policy_grpc.PolicyServiceStub:
    return policy_grpc.PolicyServiceStub(channels["policy"])


@pytest.fixture(scope="module")
def learner_stub(channels: dict[str, grpc.Channel]) -> learner_grpc.LearnerServiceStub:
    return learner_grpc.LearnerServiceStub(channels["learner"])


@pytest.fixture(scope="module")
def versions_before(policy_stub: policy_grpc.PolicyServiceStub) -> int:
    return policy_stub.Describe(policy_pb2.PolicyServiceDescribeRequest(), timeout=CALL_TIMEOUT_S).policy_version


# ---------------------------------------------------------------- environment service

ENV_REQUESTS = st.one_of(
    message_strategy(env_pb2.ResetRequest, ENV_HINTS),
    message_strategy(env_pb2.StepRequest, ENV_HINTS),
    message_strategy(env_pb2.StepRequest, ENV_HINTS),
    message_strategy(env_pb2.VerifyRequest, ENV_HINTS),
    message_strategy(env_pb2.CloseRequest, ENV_HINTS),
    message_strategy(env_pb2.EnvironmentServiceDescribeRequest, ENV_HINTS, depth=1),
)


def env_method(stub: env_grpc.EnvironmentServiceStub, request: Message) -> Callable[..., Any]:
    return {env_pb2.ResetRequest: stub.Reset, env_pb2.StepRequest: stub.Step, env_pb2.VerifyRequest: stub.Verify,
            env_pb2.CloseRequest: stub.Close, env_pb2.EnvironmentServiceDescribeRequest: stub.Describe}[type(request)]


def remember(response: Any) -> None:
    if isinstance(response, env_pb2.ResetResponse):
        EPISODES.append(response.episode_id)
        OPENED.add(response.episode_id)


@settings(BASE, max_examples=800)
@given(request=ENV_REQUESTS)
def test_env_unary_calls(env_stub: env_grpc.EnvironmentServiceStub, tally: Tally, request: Message) -> None:
    code, answer = status_of(lambda: env_method(env_stub, request)(request, timeout=CALL_TIMEOUT_S))
    check(tally, f"env.{type(request).__name__}", code, answer)
    remember(answer)


SESSION_OPERATIONS = st.lists(message_strategy(env_pb2.SessionRequest, ENV_HINTS), min_size=1, max_size=6)


@settings(BASE, max_examples=120)
@given(operations=SESSION_OPERATIONS)
def test_env_session_streams(env_stub: env_grpc.EnvironmentServiceStub, tally: Tally,
                             operations: list[env_pb2.SessionRequest]) -> None:
    answers: list[env_pb2.SessionResponse] = []
    code, error = status_of(lambda: answers.extend(env_stub.Session(iter(operations), timeout=CALL_TIMEOUT_S)))
    check(tally, "env.Session", code, error, requests=len(operations))
    for answer in answers:
        if answer.WhichOneof("result") == "error":
            check_in_band(tally, "env.Session", answer.error)


# ---------------------------------------------------------------- policy service

GENERATE_REQUESTS = message_strategy(policy_pb2.GenerateRequest, POLICY_HINTS)


@settings(BASE, max_examples=300)
@given(request=GENERATE_REQUESTS)
def test_policy_generate(policy_stub: policy_grpc.PolicyServiceStub, tally: Tally,
                         request: policy_pb2.GenerateRequest) -> None:
    call = policy_stub.Generate(request, timeout=CALL_TIMEOUT_S)

    def read() -> int:
        for count, _ in enumerate(call, start=1):
            if count == GENERATE_EVENTS_READ:
                call.cancel()  # leave early: the server must drop the request's rows
                return count
        return 0

    code, answer = status_of(read)
    check(tally, "policy.Generate", code, answer)


@pytest.fixture(scope="module")
def tiny_weights() -> dict[str, Any]:
    """The tiny model's parameters as the server's manifest lists them (tied tensors once)."""
    return distinct_tensors(load_model("tiny", seed=0).model.state_dict())


def update_weights(channel: grpc.Channel, wires: list[bytes]) -> tuple[Code, Any]:
    send = channel.stream_unary("/sciproto.v1.PolicyService/UpdateWeights", request_serializer=lambda wire: wire,
                                response_deserializer=policy_pb2.UpdateWeightsResponse.FromString)
    return status_of(lambda: send(iter(wires), timeout=CALL_TIMEOUT_S))


def malformed_updates(weights: dict[str, Any], version: int) -> dict[str, list[bytes]]:
    """Update streams that must each be refused, by what is wrong with them."""
    header = header_for(weights, version)
    data = [data_message_wire(parts) for parts in chunk_parts(weights, 64 * 1024)]
    all_bytes = b"".join(bytes(policy_pb2.UpdateWeightsRequest.FromString(wire).data) for wire in data)

    def header_with(edit: Callable[[policy_pb2.WeightsHeader], None]) -> bytes:
        edited = policy_pb2.WeightsHeader()
        edited.CopyFrom(header)
        edit(edited)
        return policy_pb2.UpdateWeightsRequest(header=edited).SerializeToString()

    def as_data(payload: bytes) -> bytes:
        return policy_pb2.UpdateWeightsRequest(data=payload).SerializeToString()

    good_header = policy_pb2.UpdateWeightsRequest(header=header).SerializeToString()
    return {
        "no messages": [],
        "header only": [good_header],
        "truncated": [good_header, *data[:-1]],
        "one byte short": [good_header, as_data(all_bytes[:-1])],
        "extra bytes": [good_header, *data, as_data(b"\x00" * 7)],
        "data before header": [*data[:1], good_header, *data[1:]],
        "two headers": [good_header, good_header, *data],
        "empty first message": [b""],
        "stale version": [header_with(lambda h: setattr(h, "policy_version", 0)), *data],
        "unknown tensor": [header_with(lambda h: setattr(h.tensors[0], "name", "not.a.parameter")), *data],
        "tensor twice": [header_with(lambda h: h.tensors.append(h.tensors[0])), *data],
        "tensor missing": [header_with(lambda h: h.tensors.pop()), *data],
        "wrong shape": [header_with(lambda h: h.tensors[0].shape.append(1)), *data],
        "wrong dtype": [header_with(lambda h: setattr(h.tensors[0], "dtype", policy_pb2.TENSOR_DTYPE_BFLOAT16)), *data],
        "unknown dtype": [header_with(lambda h: setattr(h.tensors[0], "dtype", 77)), *data],
        "wrong total": [header_with(lambda h: setattr(h, "total_bytes", h.total_bytes + 1)), *data],
        "nccl transport": [header_with(lambda h: setattr(h, "transport", policy_pb2.WEIGHT_TRANSPORT_NCCL)), *data],
        "corrupt chunk": [good_header, b"\x12\xff\xff\xff\xff\x0f" + b"\x00" * 8],
    }


def test_malformed_weight_updates_are_refused(channels: dict[str, grpc.Channel], policy_stub: policy_grpc.PolicyServiceStub,
                                              tiny_weights: dict[str, Any], versions_before: int, tally: Tally) -> None:
    for what, wires in malformed_updates(tiny_weights, versions_before + 1).items():
        code, answer = update_weights(channels["policy"], wires)
        check(tally, "policy.UpdateWeights", code, answer, requests=max(len(wires), 1),
              allowed=DOCUMENTED - {Code.OK})
        version = policy_stub.Describe(policy_pb2.PolicyServiceDescribeRequest(), timeout=CALL_TIMEOUT_S).policy_version
        assert version == versions_before, f"a malformed update ({what}) changed the policy version"


@settings(BASE, max_examples=120)
@given(messages=st.lists(message_strategy(policy_pb2.UpdateWeightsRequest, POLICY_HINTS), max_size=5))
def test_random_weight_streams_are_refused(channels: dict[str, grpc.Channel], tally: Tally,
                                           messages: list[policy_pb2.UpdateWeightsRequest]) -> None:
    code, answer = update_weights(channels["policy"], [m.SerializeToString() for m in messages])
    check(tally, "policy.UpdateWeights", code, answer, requests=max(len(messages), 1), allowed=DOCUMENTED - {Code.OK})


# ---------------------------------------------------------------- learner service


@st.composite
def aligned_rollouts(draw: st.DrawFn) -> learner_pb2.Rollout:
    """Rollouts whose lists line up, so they get past the shape checks to the values."""
    length = draw(st.integers(1, 12))
    floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
    start = draw(st.integers(0, length))
    return learner_pb2.Rollout(
        sample_index=draw(st.integers(0, 2**32 - 1)),
        token_ids=draw(st.lists(steered(1, 40, 261, 262, 2**32 - 1, other=st.integers(0, 261)),
                                min_size=length, max_size=length)),
        loss_mask=[0] * start + draw(st.lists(steered(1, other=st.integers(0, 3)), min_size=length - start,
                                              max_size=length - start)),
        rollout_logprobs=draw(st.lists(st.one_of(st.just(-1.0), floats), min_size=length, max_size=length)),
        version_spans=[common_pb2.VersionSpan(start=start, end=length,
                                              policy_version=draw(steered(0, 1, -1, other=st.sampled_from(INT_EDGES))))],
        reward=common_pb2.Reward(value=draw(st.one_of(st.sampled_from([0.0, 1.0]), st.floats())),
                                 status=draw(steered(1, other=st.integers(-1, 5)))),
        turns=draw(st.sampled_from(UINT_EDGES)),
    )


ROLLOUTS = st.one_of(aligned_rollouts(), aligned_rollouts(), message_strategy(learner_pb2.Rollout, depth=2))
GROUPS = st.builds(
    lambda group_id, env, rollouts: learner_pb2.TrainStepRequest(
        group=learner_pb2.RolloutGroup(group_id=group_id, env=env, task_id="fuzz", rollouts=rollouts)),
    st.one_of(st.uuids().map(str), steered("dup-1", "dup-2", "", other=texts())),
    texts(),
    st.lists(ROLLOUTS, max_size=5),
)


@settings(BASE, max_examples=120)
@given(requests=st.lists(st.one_of(GROUPS, GROUPS, message_strategy(learner_pb2.TrainStepRequest, depth=3)),
                         min_size=1, max_size=4))
def test_learner_train_step_streams(learner_stub: learner_grpc.LearnerServiceStub, tally: Tally,
                                    requests: list[learner_pb2.TrainStepRequest]) -> None:
    answers: list[learner_pb2.TrainStepResponse] = []
    code, error = status_of(lambda: answers.extend(learner_stub.TrainStep(iter(requests), timeout=CALL_TIMEOUT_S)))
    check(tally, "learner.TrainStep", code, error, requests=len(requests))
    for answer in answers:
        if answer.WhichOneof("event") == "error":
            check_in_band(tally, "learner.TrainStep", answer.error)
        elif answer.WhichOneof("event") == "receipt":
            tally.saw("learner.TrainStep (receipts)", answer.receipt.reason or "accepted", requests=0)


# ---------------------------------------------------------------- bytes on the wire

UNARY_METHODS = {
    "/sciproto.v1.EnvironmentService/Describe": env_pb2.EnvironmentServiceDescribeRequest(request_id="r"),
    "/sciproto.v1.EnvironmentService/Reset": env_pb2.ResetRequest(env="toy", task_ref=env_pb2.TaskRef(split="train")),
    "/sciproto.v1.EnvironmentService/Step": env_pb2.StepRequest(
        episode_id="e", action=common_pb2.ChatMessage(role=3, tool_calls=[common_pb2.ToolCall(id="a", name="calculator")])),
    "/sciproto.v1.EnvironmentService/Verify": env_pb2.VerifyRequest(episode_id="e"),
    "/sciproto.v1.EnvironmentService/Close": env_pb2.CloseRequest(episode_id="e"),
    "/sciproto.v1.PolicyService/Describe": policy_pb2.PolicyServiceDescribeRequest(request_id="r"),
    "/sciproto.v1.LearnerService/Describe": learner_pb2.LearnerServiceDescribeRequest(request_id="r"),
}
STREAMING_METHODS = {
    "/sciproto.v1.PolicyService/Generate": policy_pb2.GenerateRequest(
        tokens=policy_pb2.TokenPrompt(token_ids=[1, 2]), sampling=policy_pb2.SamplingParams(max_tokens=2)),
    "/sciproto.v1.EnvironmentService/Session": env_pb2.SessionRequest(close=env_pb2.CloseRequest(episode_id="e")),
    "/sciproto.v1.LearnerService/TrainStep": learner_pb2.TrainStepRequest(group=learner_pb2.RolloutGroup(group_id="g")),
    "/sciproto.v1.PolicyService/UpdateWeights": policy_pb2.UpdateWeightsRequest(header=policy_pb2.WeightsHeader()),
}
SERVER_OF = {"EnvironmentService": "env", "PolicyService": "policy", "LearnerService": "learner"}


def wire_call(channels: dict[str, grpc.Channel], method: str, wire: bytes) -> tuple[Code, Any]:
    channel = channels[SERVER_OF[method.split("/")[1].split(".")[-1]]]
    raw = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}
    if method.endswith("/Reset"):  # a mutation may still be a valid Reset: close what it opens
        code, answer = status_of(lambda: channel.unary_unary(method, **raw)(wire, timeout=CALL_TIMEOUT_S))
        if code == Code.OK:
            remember(env_pb2.ResetResponse.FromString(answer))
        return code, answer
    if method in UNARY_METHODS:
        return status_of(lambda: channel.unary_unary(method, **raw)(wire, timeout=CALL_TIMEOUT_S))
    if method.endswith("/Generate"):
        return status_of(lambda: list(channel.unary_stream(method, **raw)(wire, timeout=CALL_TIMEOUT_S)))
    if method.endswith("/UpdateWeights"):
        return status_of(lambda: channel.stream_unary(method, **raw)(iter([wire]), timeout=CALL_TIMEOUT_S))
    return status_of(lambda: list(channel.stream_stream(method, **raw)(iter([wire]), timeout=CALL_TIMEOUT_S)))


@settings(BASE, max_examples=300)
@given(method_and_wire=st.sampled_from(sorted({**UNARY_METHODS, **STREAMING_METHODS})).flatmap(
    lambda method: st.tuples(st.just(method), mutations([{**UNARY_METHODS, **STREAMING_METHODS}[method]
                                                          .SerializeToString()]))))
def test_mutated_bytes_on_the_wire(channels: dict[str, grpc.Channel], tally: Tally,
                                   method_and_wire: tuple[str, bytes]) -> None:
    method, wire = method_and_wire
    code, answer = wire_call(channels, method, wire)
    # Session answers bad operations in band and ends OK; a stream that cannot parse ends there too.
    check(tally, f"wire {method.rsplit('/', 2)[-2].split('.')[-1]}.{method.rsplit('/', 1)[-1]}", code, answer)


def test_messages_beyond_the_receive_limit_are_resource_exhausted(channels: dict[str, grpc.Channel], tally: Tally) -> None:
    huge = "x" * (RECEIVE_LIMIT_BYTES + 1024)
    oversized = {
        "/sciproto.v1.EnvironmentService/Reset": env_pb2.ResetRequest(env=huge),
        "/sciproto.v1.EnvironmentService/Step": env_pb2.StepRequest(episode_id=huge),
        "/sciproto.v1.EnvironmentService/Session": env_pb2.SessionRequest(close=env_pb2.CloseRequest(episode_id=huge)),
        "/sciproto.v1.PolicyService/Generate": policy_pb2.GenerateRequest(request_id=huge),
        "/sciproto.v1.PolicyService/UpdateWeights": policy_pb2.UpdateWeightsRequest(data=huge.encode()),
        "/sciproto.v1.LearnerService/TrainStep": learner_pb2.TrainStepRequest(request_id=huge),
        "/sciproto.v1.LearnerService/Describe": learner_pb2.LearnerServiceDescribeRequest(request_id=huge),
    }
    for method, message in oversized.items():
        code, answer = wire_call(channels, method, message.SerializeToString())
        tally.saw(f"oversized {method.rsplit('/', 1)[-1]}", code.name)
        assert code == Code.RESOURCE_EXHAUSTED, f"{method} with {len(huge)} bytes answered {code.name}: {answer}"


# ---------------------------------------------------------------- afterwards


def wait_for(probe: Callable[[], Any], expected: Any, timeout_s: float = 30.0) -> Any:
    """probe() once it equals `expected`, or its last value after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (value := probe()) != expected and time.monotonic() < deadline:
        time.sleep(0.1)
    return value


def test_servers_are_up_and_their_counters_back_to_zero(
    fuzzed_servers: dict[str, ServerProcess], env_stub: env_grpc.EnvironmentServiceStub,
    policy_stub: policy_grpc.PolicyServiceStub, learner_stub: learner_grpc.LearnerServiceStub,
    versions_before: int, tally: Tally,
) -> None:
    for episode_id in OPENED:
        env_stub.Close(env_pb2.CloseRequest(episode_id=episode_id), timeout=CALL_TIMEOUT_S)
    for name, server in fuzzed_servers.items():
        assert server.alive(), f"the {name} server died:\n" + "\n".join(server.output)
        assert health_status(server.target) == health_pb2.HealthCheckResponse.SERVING, name
    live = wait_for(lambda: env_stub.Describe(env_pb2.EnvironmentServiceDescribeRequest(),
                                              timeout=CALL_TIMEOUT_S).counters.live_episodes, 0)
    active = wait_for(lambda: policy_stub.Describe(policy_pb2.PolicyServiceDescribeRequest(),
                                                   timeout=CALL_TIMEOUT_S).active_requests, 0)
    policy = policy_stub.Describe(policy_pb2.PolicyServiceDescribeRequest(), timeout=CALL_TIMEOUT_S)
    learner = learner_stub.Describe(learner_pb2.LearnerServiceDescribeRequest(), timeout=CALL_TIMEOUT_S)
    for name, server in fuzzed_servers.items():
        tracebacks = [line for line in server.output if "Traceback" in line or "unexpected error" in line]
        tally.saw(f"{name} server log", f"{len(tracebacks)} tracebacks", requests=0)
    assert live == 0, f"{live} episodes are still open after closing every one the fuzz opened"
    assert active == 0, f"{active} Generate requests still count as active"
    assert policy.policy_version == versions_before, "malformed updates changed the policy version"
    assert learner.buffer.capacity > 0
