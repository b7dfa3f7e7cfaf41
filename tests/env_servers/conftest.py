"""Env server processes shared by the tests of this folder."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sciproto.client.env import EnvClient, tool_calls_action
from sciproto.pb import common_pb2
from sciproto.processes import ServerProcess, start_server
from tests.conftest import NOTEBOOK_SANDBOX

LOG_DIR = Path(__file__).resolve().parents[2] / ".test-artifacts"


def serve_env(name: str, *settings: str) -> Iterator[ServerProcess]:
    """Start `sciproto serve env` with `--set` settings; stop it when the fixture ends."""
    LOG_DIR.mkdir(exist_ok=True)
    args = ["serve", "env", "--port", "0"]
    hosts_notebook = any("notebook" in setting for setting in settings if setting.startswith("envs="))
    if hosts_notebook and not any(setting.startswith("env_options.notebook.sandbox=") for setting in settings):
        settings = (*settings, f"env_options.notebook.sandbox={NOTEBOOK_SANDBOX}")
    for setting in settings:
        args += ["--set", setting]
    server = start_server(args, timeout_s=120, log_file=LOG_DIR / f"env-server-{name}.log")
    try:
        yield server
    finally:
        server.stop(grace_s=15)


@pytest.fixture(scope="session")
def env_server() -> Iterator[ServerProcess]:
    """gsm8k and notebook with fast heartbeats, shared by the modules here."""
    yield from serve_env("main", "envs=[gsm8k,notebook]", "heartbeat_interval_s=0.2")


async def live_episodes(target: str) -> int:
    async with EnvClient(target) as client:
        return (await client.describe()).counters.live_episodes


async def wait_for_live_episodes(target: str, expected: int, timeout_s: float = 60.0) -> int:
    """Live episodes once they are `expected` (closing happens after a stream ends), or as
    they are after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (live := await live_episodes(target)) != expected and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return live


# Actions the env-server tests send.
def submit(answer: str) -> common_pb2.ChatMessage:
    return tool_calls_action(("submit_answer", {"answer": answer}))


def edit_cell(code: str) -> common_pb2.ChatMessage:
    return tool_calls_action(("edit_cell", {"contents": code}))


def text(messages: list[common_pb2.ChatMessage]) -> str:
    return "\n".join(message.content for message in messages)
