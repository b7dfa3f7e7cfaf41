from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import openai
import pytest

from sciproto.processes import ServerProcess, start_server


def serve_gateway(*args: str) -> ServerProcess:
    return start_server(["serve", "gateway", "--port", "0", *args], timeout_s=120)


@contextmanager
def running_gateway(*args: str) -> Iterator[ServerProcess]:
    """`sciproto serve gateway` with `args` in its own process, stopped on leaving."""
    server = serve_gateway(*args)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(gateway: ServerProcess) -> openai.OpenAI:
    """The `openai` SDK on the module's `gateway` fixture, outside any session."""
    return openai.OpenAI(base_url=f"http://{gateway.target}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tiny_policy() -> Iterator[ServerProcess]:
    """A tiny policy server (random weights, the Qwen chat template) in its own process."""
    server = start_server(["serve", "policy", "--port", "0", "--model", "tiny", "--set", "seed=3",
                           "--set", "transformers.batch_window_s=0.002"], timeout_s=300)
    try:
        yield server
    finally:
        server.stop()
