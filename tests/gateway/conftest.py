from __future__ import annotations

from collections.abc import Iterator

import pytest

from sciproto.processes import ServerProcess, start_server


def serve_gateway(*args: str) -> ServerProcess:
    return start_server(["serve", "gateway", "--port", "0", *args], timeout_s=120)


@pytest.fixture(scope="module")
def tiny_policy() -> Iterator[ServerProcess]:
    """A tiny policy server (random weights, the Qwen chat template) in its own process."""
    server = start_server(["serve", "policy", "--port", "0", "--model", "tiny", "--set", "seed=3",
                           "--set", "transformers.batch_window_s=0.002"], timeout_s=300)
    try:
        yield server
    finally:
        server.stop()
