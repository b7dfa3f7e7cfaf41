"""The notebook's pool of warm sandboxed kernels, on real server processes: an episode never sees
what an earlier one left, the pool refills after a burst, a dead pooled kernel is replaced and
never handed out, a stopped server leaves no kernel and no workspace behind, and the pool yields
to the server's episode limit and to memory pressure (Resets then start kernels on demand)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from env_servers.sandbox import _descendants
from sciproto.client.env import EnvClient, EnvSession
from sciproto.pb import env_pb2
from sciproto.processes import ServerProcess
from tests.env_servers.conftest import edit_cell, serve_env, text

POOL_SIZE = 2


@pytest.fixture(scope="module")
def pool_server() -> Iterator[ServerProcess]:
    yield from serve_env("kernel-pool", "envs=[notebook]", f"env_options.notebook.pool_size={POOL_SIZE}")


async def pool(target: str) -> env_pb2.WarmPool:
    async with EnvClient(target) as client:
        described = await client.describe()
    return {env.name: env for env in described.environments}["notebook"].warm_pool


async def wait_until_full(target: str, timeout_s: float = 90.0) -> env_pb2.WarmPool:
    deadline = time.monotonic() + timeout_s
    while (state := await pool(target)).warm < state.size and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert state.warm == state.size, f"the pool did not fill within {timeout_s:g} s: {state}"
    return state


async def report(client: EnvSession, episode: str, body: str) -> dict:
    """Run `body` (which fills `seen`) as a cell; what it reported."""
    step = await client.step(episode, edit_cell(
        "import json, os, sys\nseen = {}\n" + body + "\nprint('@@' + json.dumps(seen))"), timeout=120)
    lines = [line for line in text(list(step.observations)).splitlines() if line.startswith("@@")]
    assert lines, f"the cell printed no report: {text(list(step.observations))[-2000:]}"
    return json.loads(lines[-1][2:])


async def open_episode(client: EnvSession) -> str:
    return (await client.reset("notebook", split="test", index=0, timeout=120)).episode_id


async def test_describe_shows_the_pool_and_an_episode_takes_a_fresh_kernel_every_time(
        pool_server: ServerProcess) -> None:
    before = await wait_until_full(pool_server.target)
    assert (before.size, list(before.preload)) == (POOL_SIZE, ["pandas", "numpy"])
    async with EnvClient(pool_server.target) as unary, unary.session() as client:
        first = await open_episode(client)
        left = await report(client, first, (
            "open('left_behind.txt', 'w').write('mine')\n"
            "left_behind_variable = 42\n"
            "seen['cwd'] = os.getcwd()\n"
            "seen['pid'] = os.getpid()"))
        await client.close(first)
        await wait_until_full(pool_server.target)
        second = await open_episode(client)
        found = await report(client, second, (
            "seen['variable'] = 'left_behind_variable' in globals()\n"
            "seen['file'] = os.path.exists('left_behind.txt')\n"
            "seen['cwd'] = os.getcwd()\n"
            "seen['files'] = sorted(os.listdir('.'))\n"
            "seen['preloaded'] = 'pandas' in sys.modules and 'numpy' in sys.modules\n"
            "seen['names'] = [n for n in globals() if n in ('pandas', 'numpy') or 'sciproto' in n]"))
        await client.close(second)
    after = await pool(pool_server.target)
    assert (found["variable"], found["file"]) == (False, False), found
    assert found["cwd"] != left["cwd"] and not Path(left["cwd"]).exists()
    assert "orders.csv" in found["files"] or any(name.endswith(".csv") for name in found["files"]), found
    assert found["preloaded"] and found["names"] == [], found
    assert after.hits - before.hits == 2 and after.misses == before.misses, (before, after)


async def test_the_pool_refills_after_a_burst_of_resets(pool_server: ServerProcess) -> None:
    before = await wait_until_full(pool_server.target)
    burst = POOL_SIZE + 2
    async with EnvClient(pool_server.target) as unary, unary.session() as client:
        episodes = await asyncio.gather(*(open_episode(client) for _ in range(burst)))
        served = await asyncio.gather(*(report(client, e, "seen['sum'] = sum(range(10))") for e in episodes))
        during = await pool(pool_server.target)
        refilled = await wait_until_full(pool_server.target)
        for episode in episodes:
            await client.close(episode)
    assert served == [{"sum": 45}] * burst
    taken = (during.hits - before.hits) + (during.misses - before.misses)
    assert taken == burst and during.hits - before.hits >= 1, (before, during)
    assert refilled.warm == POOL_SIZE


def kernel_processes(server: ServerProcess) -> dict[int, str]:
    """The server's kernels (the Python process inside each sandbox): pid -> working directory."""
    found: dict[int, str] = {}
    for pid in _descendants(server.process.pid)[1:]:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if argv and "bwrap" not in Path(argv[0]).name and "ipykernel_launcher" in argv:
            found[pid] = cwd
    return found


async def test_a_dead_pooled_kernel_is_replaced_and_never_handed_out(pool_server: ServerProcess) -> None:
    before = await wait_until_full(pool_server.target)
    async with EnvClient(pool_server.target) as unary, unary.session() as client:
        pooled = kernel_processes(pool_server)  # no episode is open: every kernel is a pooled one
        assert len(pooled) == POOL_SIZE, pooled
        for pid in pooled:
            os.kill(pid, signal.SIGKILL)
        episode = await open_episode(client)
        got = await report(client, episode, "seen['cwd'] = os.getcwd()\nseen['sum'] = sum(range(10))")
        await client.close(episode)
        refilled = await wait_until_full(pool_server.target)
    assert got["sum"] == 45 and got["cwd"] not in pooled.values(), (got, pooled)
    assert refilled.replaced - before.replaced == POOL_SIZE, (before, refilled)
    assert not any(Path(cwd).exists() for cwd in pooled.values()), "a dead kernel's workspace was kept"


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def test_a_stopped_server_leaves_no_kernel_and_no_workspace() -> None:
    started = serve_env("kernel-pool-stop", "envs=[notebook]", f"env_options.notebook.pool_size={POOL_SIZE}")
    server = next(started)
    try:
        await wait_until_full(server.target)
        client = EnvClient(server.target)
        episode = (await client.reset("notebook", split="test", index=0, timeout=120)).episode_id
        step = await client.step(episode, edit_cell("import os\nprint('@@' + os.getcwd())"), timeout=120)
        workspace = next(line[2:] for line in text(list(step.observations)).splitlines() if line.startswith("@@"))
        await wait_until_full(server.target)  # the Reset took a kernel; its replacement starts in the background
        kernels = kernel_processes(server)
        assert len(kernels) == POOL_SIZE + 1, kernels  # the pool's and the episode's
        server.process.send_signal(signal.SIGTERM)  # with the episode still open
        assert server.process.wait(timeout=90) == 0
        with contextlib.suppress(Exception):
            await client.aclose()
    finally:
        for _ in started:
            pass
    scratch_root = Path(workspace).parent
    assert scratch_root.name.startswith("sciproto-env-"), workspace
    deadline = time.monotonic() + 10
    while (left := [pid for pid in kernels if _running(pid)]) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert left == [], f"kernels outlived their server: {left}"
    assert not scratch_root.exists(), f"the stopped server left {sorted(p.name for p in scratch_root.iterdir())}"


async def test_the_pool_counts_against_the_episode_limit() -> None:
    # Two episodes at most: with both open, the pool may hold no kernel; with one, one.
    started = serve_env("kernel-pool-room", "envs=[notebook]", f"env_options.notebook.pool_size={POOL_SIZE}",
                        "max_live_episodes=2")
    server = next(started)
    try:
        await wait_until_full(server.target)
        async with EnvClient(server.target) as unary, unary.session() as client:
            first, second = await open_episode(client), await open_episode(client)
            full = await pool(server.target)
            assert full.warm == 0 and full.starting == 0, full  # no room left for a pooled kernel
            await client.close(first)
            refilled = await wait_until_full_to(server.target, 1)
            await client.close(second)
            await wait_until_full(server.target)
            assert (await pool(server.target)).warm == POOL_SIZE
    finally:
        for _ in started:
            pass
    assert refilled.warm == 1 and refilled.starting == 0, refilled


async def wait_until_full_to(target: str, warm: int, timeout_s: float = 90.0) -> env_pb2.WarmPool:
    """The pool once it holds `warm` kernels and starts no more (within `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while ((state := await pool(target)).warm < warm or state.starting) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    return state


async def test_under_memory_pressure_the_pool_starts_nothing_and_resets_start_kernels_on_demand() -> None:
    # More memory asked to be left available than any host has: the pool never starts a kernel.
    started = serve_env("kernel-pool-pressure", "envs=[notebook]", f"env_options.notebook.pool_size={POOL_SIZE}",
                        "env_options.notebook.pool_min_available_mb=1000000000")
    server = next(started)
    try:
        async with EnvClient(server.target) as unary, unary.session() as client:
            episode = await open_episode(client)
            got = await report(client, episode, "seen['sum'] = sum(range(10))")
            state = await pool(server.target)
    finally:
        for _ in started:
            pass
    assert got == {"sum": 45}
    assert (state.size, state.warm, state.starting, state.hits, state.misses) == (POOL_SIZE, 0, 0, 0, 1), state
