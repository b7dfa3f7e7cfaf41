"""The server bootstrap and channel factory, against a real server process."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sciproto import pb
from sciproto.channel import ChannelConfig, make_channel
from sciproto.describe import list_services
from sciproto.errors import (
    DOMAIN,
    STATUS_DETAILS_KEY,
    InvalidArgument,
    NotFound,
    Reason,
    from_rpc_error,
)
from sciproto.processes import ServerProcess, sciproto_command, start_command

PROBE = Path(__file__).with_name("probe_server.py")


def start_probe(grace_s: float = 10.0) -> ServerProcess:
    return start_command([sys.executable, str(PROBE), str(grace_s)], timeout_s=60)


@pytest.fixture(scope="module")
def probe() -> Iterator[ServerProcess]:
    server = start_probe()
    yield server
    server.stop()


def step(channel: grpc.aio.Channel, episode_id: str, timeout: float | None = None):
    stub = pb.env_grpc.EnvironmentServiceStub(channel)
    return stub.Step(pb.env_pb2.StepRequest(episode_id=episode_id), timeout=timeout)


async def test_health_and_reflection(probe: ServerProcess) -> None:
    async with make_channel(probe.target) as channel:
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=pb.ENV_SERVICE))
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        services = await list_services(channel, timeout_s=10)
    assert pb.ENV_SERVICE in services
    assert "grpc.health.v1.Health" in services


def test_describe_command_prints_health_and_describe(probe: ServerProcess) -> None:
    result = subprocess.run(sciproto_command("describe", probe.target), check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    described = json.loads(result.stdout)
    assert described["health"] == "SERVING"
    server = described[pb.ENV_SERVICE]["server"]
    assert server["implementation"] == "probe"
    assert int(server["limits"]["max_receive_message_bytes"]) == 1024 * 1024


async def test_bad_request_gets_invalid_argument_with_error_info(probe: ServerProcess) -> None:
    async with make_channel(probe.target) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await step(channel, "")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = dict(caught.value.trailing_metadata())[STATUS_DETAILS_KEY]
    from google.rpc import status_pb2

    status = status_pb2.Status.FromString(details)
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    assert (info.reason, info.domain) == (Reason.INVALID_REQUEST, DOMAIN)
    typed = from_rpc_error(caught.value)
    assert isinstance(typed, InvalidArgument) and typed.reason == Reason.INVALID_REQUEST
    assert "Reset" in typed.message


async def test_unknown_episode_and_crash_keep_the_server_up(probe: ServerProcess) -> None:
    async with make_channel(probe.target) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as not_found:
            await step(channel, "nope")
        with pytest.raises(grpc.aio.AioRpcError) as crashed:
            await step(channel, "crash")
        answered = await step(channel, "sleep:0")
    assert isinstance(from_rpc_error(not_found.value), NotFound)
    assert from_rpc_error(not_found.value).reason == Reason.EPISODE_NOT_FOUND
    assert crashed.value.code() == grpc.StatusCode.INTERNAL
    assert "RuntimeError" in crashed.value.details() and "Traceback" not in crashed.value.details()
    assert answered.step_count == 1 and probe.alive()


async def test_deadline_is_honoured(probe: ServerProcess) -> None:
    async with make_channel(probe.target) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await step(channel, "sleep:30", timeout=0.5)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_default_deadline_from_channel_config(probe: ServerProcess) -> None:
    config = ChannelConfig(target=probe.target, default_timeout_s=0.5)
    async with make_channel(config) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await step(channel, "sleep:30")
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_sigterm_drains_in_flight_call() -> None:
    server = start_probe(grace_s=20)
    try:
        async with make_channel(ChannelConfig(target=server.target, max_attempts=1)) as channel:
            in_flight = asyncio.ensure_future(step(channel, "sleep:2"))
            await asyncio.sleep(0.5)  # the call is now running on the server
            server.process.send_signal(signal.SIGTERM)
            response = await asyncio.wait_for(in_flight, timeout=30)
            assert response.step_count == 1
            exit_code = await asyncio.to_thread(server.process.wait, 30)
        assert exit_code == 0
    finally:
        server.kill()


async def test_retries_are_bounded_when_nothing_listens() -> None:
    config = ChannelConfig(target="127.0.0.1:1", max_attempts=3, initial_backoff_s=0.05, max_backoff_s=0.1,
                           default_timeout_s=20)
    async with make_channel(config) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await step(channel, "x")
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
