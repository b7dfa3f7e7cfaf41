"""Session control (protocol 1.2) on real server processes: `cancel` stops one running
operation and leaves its episode in a clear state, `max_in_flight` refuses operations beyond it
in-band with RetryInfo, and every frame is charged to the principal's request rate."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from sciproto.channel import ChannelConfig, make_channel
from sciproto.conformance.env_checks import SessionProbe
from sciproto.conformance.wire import decode_status
from sciproto.pb import common_pb2, env_grpc, env_pb2
from sciproto.processes import ServerProcess
from tests.env_servers.conftest import serve_env

MAX_IN_FLIGHT = 2


@pytest.fixture(scope="module")
def control_server() -> Iterator[ServerProcess]:
    yield from serve_env("session-control", "envs=[notebook,toy]", f"session_max_in_flight={MAX_IN_FLIGHT}",
                         "heartbeat_interval_s=0.2", "retry_after_s=0.5")


def reset(env: str, index: int = 0) -> env_pb2.SessionRequest:
    return env_pb2.SessionRequest(reset=env_pb2.ResetRequest(
        request_id=secrets.token_hex(8), env=env, task_ref=env_pb2.TaskRef(split="test", index=index)))


def sleep_cell(episode_id: str, seconds: float) -> env_pb2.SessionRequest:
    call = common_pb2.ToolCall(id="call_sleep", name="edit_cell",
                               arguments=f'{{"contents": "import time\\ntime.sleep({seconds})"}}')
    return env_pb2.SessionRequest(step=env_pb2.StepRequest(
        request_id=secrets.token_hex(8), episode_id=episode_id,
        action=common_pb2.ChatMessage(role=common_pb2.ROLE_ASSISTANT, tool_calls=[call])))


def cancel(target: env_pb2.SessionRequest) -> env_pb2.SessionRequest:
    return env_pb2.SessionRequest(cancel=env_pb2.CancelRequest(
        request_id=secrets.token_hex(8), target_request_id=target.step.request_id or target.reset.request_id))


async def test_cancel_stops_a_running_step_and_ends_its_episode(control_server: ServerProcess) -> None:
    async with make_channel(ChannelConfig(target=control_server.target, max_attempts=1)) as channel:
        stub = env_grpc.EnvironmentServiceStub(channel)
        session = SessionProbe(stub, timeout_s=60)
        try:
            episode = (await session.ask(reset("notebook"))).reset.episode_id
            slow = sleep_cell(episode, 60)
            running = session.submit(slow)
            await asyncio.sleep(1.0)  # the cell is running in the kernel
            started = time.monotonic()
            stopped = await session.ask(cancel(slow))
            answer = await asyncio.wait_for(running, 10)
            waited = time.monotonic() - started
            again = await session.ask(cancel(slow))  # already answered: nothing to stop
            unknown = await session.ask(env_pb2.SessionRequest(cancel=env_pb2.CancelRequest(
                request_id="c-unknown", target_request_id="never-sent")))
            verified = await session.ask(env_pb2.SessionRequest(verify=env_pb2.VerifyRequest(
                request_id="v", episode_id=episode)))
            next_step = await session.ask(sleep_cell(episode, 0))
            await session.end()
        finally:
            await session.cancel()
    assert stopped.cancel.cancelled and stopped.episode_id == episode
    error = decode_status(answer.error)
    assert (error.code, error.reason) == (grpc.StatusCode.CANCELLED, "CANCELLED"), error
    assert waited < 10  # not the 60 s the cell would have taken
    assert not again.cancel.cancelled and not unknown.cancel.cancelled
    assert verified.verify.reward.status == common_pb2.REWARD_STATUS_INFRA_ERROR
    assert "cancelled" in verified.verify.reward.detail
    assert decode_status(next_step.error).reason == "EPISODE_FINISHED"


async def test_operations_beyond_max_in_flight_are_refused_in_band(control_server: ServerProcess) -> None:
    async with make_channel(ChannelConfig(target=control_server.target, max_attempts=1)) as channel:
        stub = env_grpc.EnvironmentServiceStub(channel)
        described = await stub.Describe(env_pb2.EnvironmentServiceDescribeRequest())
        session = SessionProbe(stub, timeout_s=60)
        try:
            episodes = [(await session.ask(reset("notebook", index))).reset.episode_id for index in range(2)]
            slow = [session.submit(sleep_cell(episode, 2)) for episode in episodes]
            await asyncio.sleep(0.5)
            refused = await session.ask(reset("toy"))
            cancels_pass = await session.ask(env_pb2.SessionRequest(cancel=env_pb2.CancelRequest(
                request_id="c", target_request_id="none")))
            done = await asyncio.wait_for(asyncio.gather(*slow), 30)
            accepted = await session.ask(reset("toy"))  # room again
            await session.end()
        finally:
            await session.cancel()
    assert described.limits.session_max_in_flight == MAX_IN_FLIGHT
    error = decode_status(refused.error)
    assert (error.code, error.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "TOO_MANY_IN_FLIGHT"), error
    assert error.retry_delay_s == 0.5
    assert cancels_pass.WhichOneof("result") == "cancel"  # a cancel is never refused for being one too many
    assert all(answer.WhichOneof("result") == "step" for answer in done)
    assert accepted.WhichOneof("result") == "reset"


@pytest.fixture(scope="module")
def rate_limited_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, str]]:
    folder = tmp_path_factory.mktemp("rate")
    token = secrets.token_urlsafe(24)
    (folder / "agent.token").write_text(token + "\n")
    auth = Path(folder / "auth.yaml")
    auth.write_text("tokens:\n  - principal: agent\n    roles: [agent, grader, observer]\n"
                    "    token_file: agent.token\n    limits: {requests_per_second: 1, burst: 4}\n")
    for server in serve_env("session-rate", "envs=[toy]", f"auth.file={auth}"):
        yield server, token


async def test_every_session_frame_is_charged_to_the_rate(rate_limited_server: tuple[ServerProcess, str]) -> None:
    server, token = rate_limited_server
    async with make_channel(ChannelConfig(target=server.target, token=token, max_attempts=1)) as channel:
        session = SessionProbe(env_grpc.EnvironmentServiceStub(channel), timeout_s=30)
        try:
            # The stream's call takes one token of the burst of 4; 6 frames at once get 3 more.
            answers = await asyncio.gather(*(session.ask(env_pb2.SessionRequest(verify=env_pb2.VerifyRequest(
                request_id=f"v{i}", episode_id="no-such-episode"))) for i in range(6)))
            await session.end()
        finally:
            await session.cancel()
    reasons = [decode_status(answer.error).reason for answer in answers]
    assert reasons.count("RATE_LIMITED") >= 2, reasons
    assert "EPISODE_NOT_FOUND" in reasons  # the ones within the rate ran
    limited = next(decode_status(a.error) for a in answers if decode_status(a.error).reason == "RATE_LIMITED")
    assert limited.code == grpc.StatusCode.RESOURCE_EXHAUSTED and limited.retry_delay_s and limited.retry_delay_s > 0
