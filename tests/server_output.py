"""Waiting on what a server process prints (its `ServerProcess.output`), for tests that act when
it reaches a point: a fault hook's 'holding at ...' line, say."""

from __future__ import annotations

import asyncio
import time

from sciproto.processes import ServerProcess


async def wait_for_line(server: ServerProcess, text: str, timeout_s: float) -> None:
    """Return once a line of `server`'s output contains `text`; fail if it exits or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while not any(text in line for line in list(server.output)):
        assert server.alive(), "\n".join(server.output)
        assert time.monotonic() < deadline, f"no {text!r} in:\n" + "\n".join(server.output)
        await asyncio.sleep(0.1)
