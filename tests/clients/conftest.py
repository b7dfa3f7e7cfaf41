"""Real env and policy server processes for the rollout client tests."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator

import pytest

from sciproto.processes import ServerProcess, start_server

ENV_ARGS = ["serve", "env", "--env", "gsm8k", "--env", "toy", "--env", "dummy"]  # dummy: an unbounded split
POLICY_ARGS = ["serve", "policy", "--model", "tiny"]

# The tiny random model rambles: keep turns and episodes short.
FAST = ["sampling.max_tokens=16", "max_steps=2", "progress=false"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="session")
def policy_server() -> Iterator[ServerProcess]:
    server = start_server([*POLICY_ARGS, "--port", "0"])
    yield server
    server.stop()


@pytest.fixture(scope="session")
def env_server() -> Iterator[ServerProcess]:
    server = start_server([*ENV_ARGS, "--port", "0"])
    yield server
    server.stop()


@pytest.fixture
def spawn_env() -> Iterator[Callable[..., ServerProcess]]:
    """Start extra env servers for one test (to kill them); all are stopped afterwards."""
    started: list[ServerProcess] = []

    def spawn(port: int = 0) -> ServerProcess:
        server = start_server([*ENV_ARGS, "--port", str(port)])
        started.append(server)
        return server

    yield spawn
    for server in started:
        server.stop(grace_s=5)
