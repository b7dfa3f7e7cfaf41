"""What an env server leaves on disk when it is killed: its episodes' workspaces and kernel
runtime directories stay behind (nothing runs its clean-up), and the next server to start removes
them, but never those of a server still running."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from env_servers.sandbox import _descendants
from sciproto.client.env import EnvClient
from sciproto.processes import ServerProcess
from tests.env_servers.conftest import edit_cell, serve_env, text


def runtime_dirs(server: ServerProcess) -> set[Path]:
    """The runtime directories of the server's kernels: where their connection files (`-f`) are."""
    found = set()
    for pid in _descendants(server.process.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if "ipykernel_launcher" in argv and "-f" in argv:
            found.add(Path(argv[argv.index("-f") + 1]).parent)
    return found


async def open_episode(client: EnvClient) -> tuple[str, Path]:
    """A notebook episode (open while `client` is) and its workspace (where its cells run)."""
    episode = (await client.reset("notebook", split="test", index=0, timeout=120)).episode_id
    step = await client.step(episode, edit_cell("import os\nprint('cwd=' + os.getcwd())"), timeout=120)
    return episode, workspace_in(text(list(step.observations)))


def workspace_in(output: str) -> Path:
    """The directory a cell printed as `cwd=<path>` (the notebook shows it inside its JSON)."""
    found = re.search(r"^cwd=(/[\w./-]+)", output, re.MULTILINE)  # ends where the JSON's `\n",` begins
    assert found, f"no cwd= line in the cell's output: {output!r}"
    return Path(found.group(1))


def test_a_printed_workspace_is_read_whole_whatever_its_name_ends_with() -> None:
    # mkdtemp's names end in any of [a-z0-9_]: one that ends in "n" was cut short (1 in 37).
    for name in ("sciproto-ws-52rfek93", "sciproto-ws-tnuw5akn", "sciproto-ws-abc_def_"):
        printed = f'cwd=/tmp/sciproto-env-1-x/{name}\\n",'
        assert workspace_in(f'[{{"text": "x"}}\n{printed}\n]') == Path(f"/tmp/sciproto-env-1-x/{name}")


def _server(name: str) -> tuple[Iterator[ServerProcess], ServerProcess]:
    started = serve_env(name, "envs=[notebook]")
    return started, next(started)


async def test_a_killed_servers_directories_are_removed_at_the_next_start_and_a_live_ones_kept() -> None:
    killed_fixture, killed = _server("leftovers-killed")
    live_fixture, live = _server("leftovers-live")
    try:
        async with EnvClient(killed.target) as killed_client, EnvClient(live.target) as live_client:
            await _killed_and_restarted(killed, killed_client, live, live_client)
    finally:
        for fixture in (killed_fixture, live_fixture):
            for _ in fixture:
                pass


async def _killed_and_restarted(killed: ServerProcess, killed_client: EnvClient,
                                live: ServerProcess, live_client: EnvClient) -> None:
    later_fixture: Iterator[ServerProcess] | None = None
    try:
        _, killed_workspace = await open_episode(killed_client)
        killed_runtime = runtime_dirs(killed)
        live_episode, live_workspace = await open_episode(live_client)
        live_runtime = runtime_dirs(live)
        assert killed_runtime and live_runtime and killed_workspace.is_dir() and live_workspace.is_dir()
        killed.kill()  # SIGKILL: no shutdown code runs
        left = [path for path in (killed_workspace, *killed_runtime) if path.exists()]
        assert left, "a SIGKILLed server left nothing behind; this test has nothing to check"

        later_fixture, _ = _server("leftovers-later")
        assert [path for path in (killed_workspace, *killed_runtime) if path.exists()] == [], \
            "the next server start left a killed server's directories in place"
        assert live_workspace.is_dir() and all(path.is_dir() for path in live_runtime), \
            "the next server start removed a live server's directories"
        step = await live_client.step(live_episode, edit_cell("print(6 * 7)"), timeout=120)  # it still runs
        assert "42" in text(list(step.observations))
    finally:
        if later_fixture is not None:
            for _ in later_fixture:
                pass
