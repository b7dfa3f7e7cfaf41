"""A client refuses a server of another major protocol version, with an error that says so: the
environment, policy and learner clients, and the gateway's command line, against real servers
(each its own process) that report protocol 2.0 in Describe (tests/conformance/major_version_server.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from clients.train.display import RunStatus
from clients.train.flow import GroupLedger
from clients.train.stream import LearnerStream
from sciproto.client.env import EnvClient
from sciproto.client.policy import PolicyClient
from sciproto.errors import FailedPrecondition, Reason
from sciproto.processes import ServerProcess, sciproto_command, start_command
from sciproto.version import PROTOCOL_VERSION
from tests.conformance.conftest import LOG_DIR, ROOT, outcomes, run_kit


def future_server(name: str, *args: str) -> ServerProcess:
    return start_command([sys.executable, "-m", "tests.conformance.major_version_server", "serve", *args,
                          "--port", "0"], timeout_s=180, cwd=ROOT, log_file=LOG_DIR / f"protocol-2-{name}.log")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    LOG_DIR.mkdir(exist_ok=True)
    run_dir = tmp_path_factory.mktemp("learner")
    commands = {"env": ("env", "--env", "toy"), "policy": ("policy", "--model", "tiny"),
                "learner": ("learner", "--set", f"run_dir={run_dir}")}
    with ThreadPoolExecutor(len(commands)) as pool:
        futures = {name: pool.submit(future_server, name, *args) for name, args in commands.items()}
    started = {name: future.result() for name, future in futures.items() if future.exception() is None}
    try:
        failed = [future.exception() for future in futures.values() if future.exception() is not None]
        if failed:
            raise failed[0]  # type: ignore[misc]
        yield started
    finally:
        for server in started.values():
            server.stop(grace_s=15)


def assert_refused(error: FailedPrecondition, service: str, target: str) -> None:
    assert error.reason == Reason.INCOMPATIBLE_PROTOCOL
    assert f"the {service} server at {target} speaks protocol 2.0" in error.message
    assert PROTOCOL_VERSION in error.message and "major version" in error.message


async def describe_env(target: str) -> None:
    async with EnvClient(target) as env:
        await env.describe(timeout=60)


async def describe_policy(target: str) -> None:
    async with PolicyClient(target) as policy:
        await policy.describe(timeout_s=60)


@pytest.mark.parametrize(("role", "service", "describe"),
                         [("env", "environment", describe_env), ("policy", "policy", describe_policy)])
def test_a_client_refuses_a_server_of_protocol_2(servers: dict[str, ServerProcess], role: str, service: str,
                                                 describe: Callable[[str], Awaitable[None]]) -> None:
    with pytest.raises(FailedPrecondition) as caught:
        asyncio.run(describe(servers[role].target))
    assert_refused(caught.value, service, servers[role].target)


def test_learner_stream_refuses_a_learner_of_protocol_2(servers: dict[str, ServerProcess]) -> None:
    stream = LearnerStream(servers["learner"].target, GroupLedger(), RunStatus(batch_groups=1), reconnect_s=30)
    handled: list[object] = []

    async def handle(event: object) -> None:
        handled.append(event)

    with pytest.raises(FailedPrecondition) as caught:
        asyncio.run(asyncio.wait_for(stream.run(handle), 90))
    assert_refused(caught.value, "learner", servers["learner"].target)
    assert handled == [] and stream.reconnects == 0  # refused before any stream, never retried


def test_the_gateway_refuses_to_serve_over_a_policy_server_of_protocol_2(servers: dict[str, ServerProcess]) -> None:
    target = servers["policy"].target
    result = subprocess.run(sciproto_command("serve", "gateway", "--policy", target, "--port", "0"),
                            capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"the policy server at {target} speaks protocol 2.0" in lines[0], result.stderr


def test_the_kit_fails_describe_on_a_server_of_protocol_2(servers: dict[str, ServerProcess]) -> None:
    code, report = run_kit("policy", servers["policy"].target, "--only", "describe")
    assert code == 1 and outcomes(report)["describe"] == "FAIL"
