"""Escape attempts from inside a notebook cell, on a real env server process and real episodes.

Each test runs what an agent could write in `edit_cell` and asserts it did not get out of its
episode: files of the host and of other episodes stay unreadable and unwritten, the network and
the host's processes stay out of reach, and memory bombs, fork bombs and endless loops end the
cell, not the server. Every cell reports what it saw as one JSON line after "@@", so the
assertions read what the code did, not the code itself (the notebook observation shows both).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sciproto.client.env import EnvClient, EnvSession, tool_calls_action
from sciproto.pb import common_pb2, env_pb2
from sciproto.processes import ServerProcess
from tests.conftest import BWRAP_PROBLEM
from tests.env_servers.conftest import LOG_DIR, serve_env

pytestmark = pytest.mark.skipif(BWRAP_PROBLEM is not None, reason=f"no working bwrap: {BWRAP_PROBLEM}")

CELL_TIMEOUT_S = 8
SCORED = common_pb2.REWARD_STATUS_SCORED
RESULT = re.compile(r"^@@([0-9a-f]{8})(\{.*\})$", re.MULTILINE)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """A notebook server with a short cell timeout and a pool of warm kernels, its other limits
    at their defaults. Every episode of these tests runs on a kernel from the pool (open_episode
    checks it): what a pooled kernel's cell can reach is what these tests check."""
    for started in serve_env("sandbox-escapes", "envs=[notebook]", "heartbeat_interval_s=0.5",
                             f"env_options.notebook.cell_timeout_s={CELL_TIMEOUT_S}", "step_timeout_s=60",
                             "env_options.notebook.pool_size=2"):
        _targets[:] = [started.target]
        yield started


_targets: list[str] = []  # the module's server, for Describe


def cell(code: str) -> common_pb2.ChatMessage:
    return tool_calls_action(("edit_cell", {"contents": code}))


def report(body: str) -> tuple[str, str]:
    """A cell that runs `body` (which fills the dict `seen`) and prints `seen` as one JSON line
    tagged with a fresh id, and that id (the notebook observation shows every cell's output)."""
    tag = uuid.uuid4().hex[:8]
    return ("import json, os\nseen = {}\n" + body
            + f"\nprint('@' + '@' + {tag!r} + json.dumps(seen, default=str))"), tag


def attempt(expression: str) -> str:
    """Code that evaluates `expression` and returns its value, or the exception's name."""
    return f"_try(lambda: {expression})"


TRY = ("def _try(f):\n"
       "    try:\n"
       "        return f()\n"
       "    except BaseException as error:\n"
       "        return 'error: ' + type(error).__name__\n")


def text(step: env_pb2.StepResponse) -> str:
    return "\n".join(message.content for message in step.observations)


def seen(step: env_pb2.StepResponse, tag: str) -> dict[str, Any] | None:
    """What the cell tagged `tag` reported; None if it printed no report."""
    found = [report for printed, report in RESULT.findall(text(step)) if printed == tag]
    return json.loads(found[-1]) if found else None


async def run(client: EnvSession, episode_id: str, body: str) -> dict[str, Any]:
    code, tag = report(TRY + body)
    step = await client.step(episode_id, cell(code), timeout=120)
    assert step.reward.status == SCORED, step.reward.detail
    got = seen(step, tag)
    assert got is not None, f"the cell printed no report; observation:\n{text(step)[-3000:]}"
    return got


async def warm_pool() -> env_pb2.WarmPool:
    async with EnvClient(_targets[0]) as client:
        described = await client.describe()
    return {env.name: env for env in described.environments}["notebook"].warm_pool


async def open_episode(client: EnvSession, index: int = 0, timeout_s: float = 90.0) -> str:
    """A new episode, on a kernel the pool started ahead (once the pool has one ready)."""
    deadline = time.monotonic() + timeout_s
    while (before := await warm_pool()).warm == 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    episode = (await client.reset("notebook", split="test", index=index, timeout=120)).episode_id
    after = await warm_pool()
    assert (after.hits, after.misses) == (before.hits + 1, before.misses), "the episode did not get a pooled kernel"
    return episode


def processes_in(directory: str) -> list[int]:
    """Host processes whose working directory is `directory` or below it."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cwd = os.readlink(entry / "cwd")
            except OSError:
                continue
            if cwd == directory or cwd.startswith(directory + "/"):
                pids.append(int(entry.name))
    return pids


async def assert_gone(workspace: str, timeout_s: float = 20.0) -> None:
    """Once its episode is closed, nothing of a workspace remains: no process, no directory."""
    deadline = time.monotonic() + timeout_s
    while (left := processes_in(workspace)) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert left == [], f"processes left in the closed episode's workspace {workspace}: {left}"
    assert not Path(workspace).exists(), f"the closed episode's workspace {workspace} was not removed"


@pytest.fixture
def planted(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A secret in the repository (which holds the server's own files) and one in the host's /tmp."""
    LOG_DIR.mkdir(exist_ok=True)
    secret = uuid.uuid4().hex
    in_repo = LOG_DIR / f"secret-{secret[:8]}.txt"
    in_tmp = tmp_path / "token.txt"
    for path in (in_repo, in_tmp):
        path.write_text(secret)
    try:
        yield {"secret": secret, "in_repo": str(in_repo), "in_tmp": str(in_tmp)}
    finally:
        in_repo.unlink(missing_ok=True)


async def test_a_cell_cannot_read_a_secret_file_outside_its_workspace(
        server: ServerProcess, planted: dict[str, str]) -> None:
    async with EnvClient(server.target) as unary, unary.session() as client:
        episode = await open_episode(client)
        in_repo, in_tmp = planted["in_repo"], planted["in_tmp"]
        got = await run(client, episode, (
            "seen['repo'] = " + attempt(f"open({in_repo!r}).read()") + "\n"
            "seen['tmp'] = " + attempt(f"open({in_tmp!r}).read()") + "\n"
            "seen['env'] = {k: v for k, v in os.environ.items() if 'TOKEN' in k or 'KEY' in k}\n"
            "seen['ssh'] = " + attempt("os.listdir(os.path.expanduser('~/.ssh'))")))
        await client.close(episode)
    assert planted["secret"] not in json.dumps(got), got
    assert got["repo"].startswith("error") and got["tmp"].startswith("error"), got
    assert got["env"] == {}, got


async def test_a_cell_cannot_write_outside_its_workspace(server: ServerProcess) -> None:
    LOG_DIR.mkdir(exist_ok=True)
    targets = [LOG_DIR / f"written-{uuid.uuid4().hex[:8]}", Path(sys.prefix) / f"written-{uuid.uuid4().hex[:8]}"]
    async with EnvClient(server.target) as unary, unary.session() as client:
        episode = await open_episode(client)
        got = await run(client, episode, "\n".join(
            f"seen[{str(path)!r}] = " + attempt(f"open({str(path)!r}, 'w').write('escaped')") for path in targets)
            + "\nseen['workspace'] = " + attempt("open('mine.txt', 'w').write('mine')"))
        await client.close(episode)
    escaped = [path for path in targets if path.exists()]
    for path in escaped:
        path.unlink()
    assert escaped == [], f"a cell wrote {escaped}; it reported {got}"
    assert got["workspace"] == 4  # its own workspace stays writable


class LoopbackServer:
    """A TCP server on 127.0.0.1 in the test process that records every connection it accepts."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.port = self.listener.getsockname()[1]
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self.listener.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            connection.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.listener.close()


async def test_a_cell_cannot_reach_the_env_server_or_another_loopback_server(server: ServerProcess) -> None:
    other = LoopbackServer()
    try:
        async with EnvClient(server.target) as unary, unary.session() as client:
            episode = await open_episode(client)
            connect = "socket.create_connection(('127.0.0.1', {port}), timeout=3).close() or 'connected'"
            got = await run(client, episode, (
                "import socket\n"
                f"seen['env_server'] = {attempt(connect.format(port=server.port))}\n"
                f"seen['other'] = {attempt(connect.format(port=other.port))}\n"
                f"seen['outside'] = {attempt(connect.format(port=53).replace('127.0.0.1', '8.8.8.8'))}"))
            await client.close(episode)
    finally:
        other.close()
    assert got["env_server"] != "connected" and got["other"] != "connected", got
    assert got["outside"] != "connected", got
    assert other.accepted == 0


async def test_a_cell_cannot_see_or_signal_host_processes(server: ServerProcess) -> None:
    server_pid = server.process.pid
    async with EnvClient(server.target) as unary, unary.session() as client:
        episode = await open_episode(client)
        got = await run(client, episode, (
            "pids = [int(p) for p in os.listdir('/proc') if p.isdigit()]\n"
            "seen['pids'] = len(pids)\n"
            "cmdlines = [" + attempt("open(f'/proc/{p}/cmdline').read().replace(chr(0), ' ')")
            .replace("lambda:", "lambda p=p:") + " for p in pids]\n"
            "seen['cmdlines'] = [c for c in cmdlines if 'serve env' in c or 'pytest' in c]\n"
            f"seen['signal_server'] = {attempt(f'os.kill({server_pid}, 0)')}\n"
            f"seen['signal_test'] = {attempt(f'os.kill({os.getpid()}, 0)')}"))
        await client.close(episode)
    host_pids = sum(1 for p in os.listdir("/proc") if p.isdigit())
    assert got["cmdlines"] == [], "a cell saw the server's and the test's processes"
    assert got["pids"] < min(20, host_pids), got
    assert str(got["signal_server"]).startswith("error") and str(got["signal_test"]).startswith("error"), got


async def test_a_cell_cannot_read_another_live_episodes_files(server: ServerProcess) -> None:
    marker = uuid.uuid4().hex
    async with EnvClient(server.target) as unary, unary.session() as client:
        first, second = await open_episode(client, 1), await open_episode(client, 2)
        mine = await run(client, first, f"open('notes.txt', 'w').write({marker!r})\nseen['cwd'] = os.getcwd()")
        notes, parent = mine["cwd"] + "/notes.txt", str(Path(mine["cwd"]).parent)
        theirs = await run(client, second, (
            "seen['read'] = " + attempt(f"open({notes!r}).read()") + "\n"
            "seen['listed'] = " + attempt(f"os.listdir({parent!r})") + "\n"
            "seen['cwd'] = os.getcwd()"))
        await client.close(first)
        await client.close(second)
    assert marker not in json.dumps(theirs), theirs
    assert Path(mine["cwd"]).name not in json.dumps(theirs["listed"]), theirs
    assert theirs["cwd"] != mine["cwd"]


async def test_a_cell_cannot_read_root_s_home(server: ServerProcess) -> None:
    # What the sandbox may show under /root: the directories that lead to the Python install,
    # where the interpreter or its virtual environment lives there (pyenv, for instance).
    needed = {Path(p).resolve().relative_to("/root").parts[0]
              for p in (sys.base_prefix, sys.prefix) if Path(p).resolve().is_relative_to("/root")}
    try:
        host = set(os.listdir("/root")) - needed
    except PermissionError:
        host = set()
    async with EnvClient(server.target) as unary, unary.session() as client:
        episode = await open_episode(client)
        got = await run(client, episode, (
            "seen['listed'] = " + attempt("os.listdir('/root')") + "\n"
            "seen['read'] = {n: " + attempt("len(open('/root/' + n, 'rb').read())").replace("lambda:", "lambda n=n:")
            + f" for n in {sorted(host)!r}}}"))
        await client.close(episode)
    listed = got["listed"] if isinstance(got["listed"], list) else []
    assert set(listed) <= needed, f"a cell listed /root: {listed}"
    assert all(str(value).startswith("error") for value in got["read"].values()), got["read"]


async def _other_episode_keeps_answering(client: EnvSession, episode: str, hostile: asyncio.Future[Any]) -> int:
    """Steps another episode while the hostile step runs (and once more if it is already over):
    how many steps it answered, each with the right result."""
    answered = 0
    while answered == 0 or not hostile.done():
        got = await run(client, episode, "seen['sum'] = sum(range(10))")
        assert got == {"sum": 45}
        answered += 1
    return answered


async def _hostile_then_recovers(server: ServerProcess, body: str) -> tuple[dict[str, Any], dict[str, Any], int]:
    """Run a hostile cell while another episode keeps stepping; then a plain cell in the same
    episode. Returns what the hostile cell reported (or {"text": observation} when it printed no
    report), what the plain cell reported, and how many steps the other episode got meanwhile."""
    async with EnvClient(server.target) as unary, unary.session() as client:
        episode, other = await open_episode(client, 4), await open_episode(client, 3)
        workspace = (await run(client, episode, "seen['cwd'] = os.getcwd()"))["cwd"]
        code, tag = report(TRY + body)
        hostile = asyncio.ensure_future(client.step(episode, cell(code), timeout=120))
        answered = await _other_episode_keeps_answering(client, other, hostile)
        step = await hostile
        assert step.reward.status == SCORED, f"a hostile cell is the agent's mistake: {step.reward}"
        hostile_seen = seen(step, tag) or {"text": text(step)}
        after = await run(client, episode, "seen['after'] = 6 * 7")
        await client.close(episode)
    await assert_gone(workspace)
    return hostile_seen, after, answered


async def test_a_memory_bomb_ends_in_memory_error_and_the_kernel_survives(server: ServerProcess) -> None:
    # numpy.empty asks for address space and touches none of it, so even where nothing limits
    # memory this test does not take the host's memory.
    hostile, after, answered = await _hostile_then_recovers(server, (
        "import numpy as np\n"
        "chunks = []\n"
        "def bomb():\n"
        "    try:\n"
        "        while len(chunks) < 64:\n"
        "            chunks.append(np.empty(256 << 20, dtype=np.uint8))\n"
        "    except MemoryError:\n"
        "        return 'MemoryError'\n"
        "    return 'allocated'\n"
        "seen['bomb'] = bomb()\n"
        "seen['gib'] = len(chunks) / 4\n"
        "chunks.clear()"))
    assert hostile["bomb"] == "MemoryError" and hostile["gib"] < 16, hostile
    assert after == {"after": 42}
    assert answered >= 1


async def test_a_fork_bomb_is_stopped_and_the_server_keeps_answering(server: ServerProcess) -> None:
    # Bounded at 300 children that exit after 15 s, so that it cannot take the host down where
    # nothing limits processes. A cell that leaves the sandbox without a process to spare (not
    # even a thread) leaves it to a fresh kernel, so the next cell runs.
    hostile, after, answered = await _hostile_then_recovers(server, (
        "import time\n"
        "children = []\n"
        "def bomb():\n"
        "    while len(children) < 300:\n"
        "        pid = os.fork()\n"
        "        if pid == 0:\n"
        "            time.sleep(15)\n"
        "            os._exit(0)\n"
        "        children.append(pid)\n"
        "    return 'forked'\n"
        "seen['bomb'] = _try(bomb)\n"
        "seen['children'] = len(children)"))
    assert hostile["bomb"] == "error: BlockingIOError" and hostile["children"] < 300, hostile
    assert after == {"after": 42}
    assert answered >= 1


async def test_an_endless_loop_is_stopped_at_the_cell_timeout_and_the_kernel_answers_again(
        server: ServerProcess) -> None:
    started = time.monotonic()
    hostile, after, answered = await _hostile_then_recovers(server, "while True:\n    pass")
    elapsed = time.monotonic() - started
    assert "text" in hostile and f"{CELL_TIMEOUT_S} s" in hostile["text"], hostile
    assert after == {"after": 42}, "the kernel is still busy with the endless loop"
    assert answered >= 1
    assert elapsed < 60  # the loop was stopped, not waited out by the 60 s step timeout


async def test_describe_names_the_sandbox_and_its_limits(server: ServerProcess) -> None:
    async with EnvClient(server.target) as client:
        described = await client.describe()
    description = {env.name: env.description for env in described.environments}["notebook"]
    assert "sandbox: bwrap" in description and "memory 2048 MiB per process" in description, description
