"""The sandbox module and the sandboxed kernel on their own, and how the server starts (or
refuses to start) the notebook environment with and without bwrap."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import site
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aviary.core import ToolCall, ToolRequestMessage

from env_servers.catalog import load_source
from env_servers.envs.kernel import CellLimits, SandboxedKernel
from env_servers.sandbox import Sandbox, SandboxLimits, sandbox_python
from sciproto.client.env import EnvClient, tool_calls_action
from sciproto.processes import ServerProcess, sciproto_command, start_command
from tests.conftest import BWRAP_PROBLEM
from tests.env_servers.conftest import serve_env

needs_bwrap = pytest.mark.skipif(BWRAP_PROBLEM is not None, reason=f"no working bwrap: {BWRAP_PROBLEM}")


@pytest.fixture
def workspace() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="sandbox-test-"))
    (path / "data.csv").write_text("a,b\n1,2\n")
    try:
        yield path
    finally:
        subprocess.run(["rm", "-rf", str(path)], check=False)


async def run_python(sandbox: Sandbox, code: str, timeout_s: float = 30) -> dict:
    """Run `code` (which fills `seen`) in `sandbox`; what it wrote to its workspace."""
    report = sandbox.workspace / "seen.json"
    wrapped = ("import json, os, resource\nseen = {}\n" + code
               + f"\nopen({str(report)!r}, 'w').write(json.dumps(seen))")
    process = await sandbox.start([sandbox_python(), "-c", wrapped])
    try:
        await asyncio.wait_for(process.process.wait(), timeout_s)
    finally:
        await process.kill()
    assert process.returncode == 0, f"the sandboxed command exited with {process.returncode}"
    return json.loads(report.read_text())


@needs_bwrap
async def test_a_sandboxed_command_sees_its_workspace_and_the_python_install_only(workspace: Path) -> None:
    sandbox = Sandbox(workspace, SandboxLimits())
    try:
        seen = await run_python(sandbox, (
            "seen['root'] = sorted(os.listdir('/'))\n"
            "seen['cwd'] = os.getcwd()\n"
            "seen['data'] = open('data.csv').read()\n"
            "seen['env'] = sorted(os.environ)\n"
            "seen['uid'] = os.getuid()\n"
            "try:\n"
            "    open('/usr/escaped', 'w')\n"
            "    seen['usr'] = 'written'\n"
            "except OSError as error:\n"
            "    seen['usr'] = type(error).__name__\n"
            "import pandas\n"
            "seen['pandas'] = pandas.__version__"))
    finally:
        sandbox.remove()
    assert seen["cwd"] == str(workspace) and seen["data"] == "a,b\n1,2\n"
    # The top of the tree: what the Python installation needs, and /dev, /proc, /tmp.
    needed = {Path(p).resolve().parts[1] for p in (sys.base_prefix, sys.prefix, *site.getsitepackages())}
    assert set(seen["root"]) <= needed | {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc",
                                          "sbin", "tmp", "usr"}, seen["root"]
    assert not any("TOKEN" in name or "PYTHONPATH" == name for name in seen["env"])
    assert seen["usr"] in {"OSError", "PermissionError"}
    assert seen["pandas"]
    if os.geteuid() == 0:
        assert seen["uid"] == sandbox.uid != 0  # a root server's sandbox runs as a user id of its own
    assert not sandbox.runtime_dir.exists()


@needs_bwrap
async def test_limits_are_set_inside_and_a_file_over_the_size_limit_is_refused(workspace: Path) -> None:
    limits = SandboxLimits(memory_mb=1024, max_processes=32, max_file_mb=1, cpu_seconds=100)
    sandbox = Sandbox(workspace, limits)
    try:
        seen = await run_python(sandbox, (
            "seen['as'] = resource.getrlimit(resource.RLIMIT_AS)[0]\n"
            "seen['nproc'] = resource.getrlimit(resource.RLIMIT_NPROC)[0]\n"
            "seen['cpu'] = resource.getrlimit(resource.RLIMIT_CPU)[0]\n"
            "try:\n"
            "    open('big.bin', 'wb').write(b'x' * (2 << 20))\n"
            "    seen['big'] = 'written'\n"
            "except OSError as error:\n"
            "    seen['big'] = error.errno\n"
            "import errno\n"
            "seen['efbig'] = errno.EFBIG"))
    finally:
        sandbox.remove()
    assert (seen["as"], seen["nproc"], seen["cpu"]) == (1024 << 20, 32, 100)
    assert seen["big"] == seen["efbig"]


@needs_bwrap
async def test_killing_a_sandbox_ends_every_process_in_it(workspace: Path) -> None:
    sandbox = Sandbox(workspace, SandboxLimits())
    process = await sandbox.start([sandbox_python(), "-c", (
        "import subprocess, time\n"
        "subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
        "open('started', 'w').close()\n"
        "time.sleep(300)")])
    try:
        deadline = time.monotonic() + 30
        while not (workspace / "started").exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        inside = [pid for pid in _pids() if _cwd(pid) == str(workspace)]
        assert len(inside) >= 2  # the python and its detached sleep
        await process.kill()
        deadline = time.monotonic() + 10
        while (left := [pid for pid in inside if _alive(pid)]) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    finally:
        await process.kill()
        sandbox.remove()
    assert left == []


# Run as `python -c SPAWNER MODE WORKSPACE DELAYS...`: for each delay, a forked process starts a
# sandbox and SIGKILLs itself that many seconds later, before, during or after bwrap sets itself up.
SPAWNER = """
import asyncio, os, signal, sys
from pathlib import Path
from env_servers.sandbox import Sandbox, SandboxLimits, sandbox_python

async def start_then_die(workspace, delay):
    sandbox = Sandbox(workspace, SandboxLimits(), sys.argv[1])
    await sandbox.start([sandbox_python(), "-c", "import time; time.sleep(600)"])
    await asyncio.sleep(delay)
    os.kill(os.getpid(), signal.SIGKILL)

for i, delay in enumerate(sys.argv[3:]):
    workspace = Path(sys.argv[2]) / f"try{i}"
    workspace.mkdir()
    child = os.fork()
    if child == 0:
        asyncio.run(start_then_die(workspace, float(delay)))
    os.waitpid(child, 0)
"""


@pytest.mark.parametrize("mode", [pytest.param("bwrap", marks=needs_bwrap), "none"])
def test_a_server_killed_while_a_sandbox_starts_leaves_nothing_of_it_running(workspace: Path, mode: str) -> None:
    """bwrap ties itself to its parent (--die-with-parent) only part way through its set-up, and
    an unsandboxed command not at all; a server SIGKILLed at any moment of a start, or after it,
    must not leave the command running."""
    delays = [i * 0.0005 for i in range(30)] + [0.015 + i * 0.003 for i in range(10)] + [0.5]
    subprocess.run([sys.executable, "-c", SPAWNER, mode, str(workspace), *map(str, delays)], check=True,
                   timeout=120, cwd=Path(__file__).resolve().parents[2])

    # The commands sleep 600 s: one still running 60 s after the last start outlived its server. A SIGKILLed one may
    # take seconds to go on a loaded machine (the other test worker starting vLLM, say).
    left = _left_running(workspace, wait_s=60)
    assert left == [], f"{len(left)} sandbox processes outlived the process that started them: {left[:5]}"


# Run as `python -c LINGERING MODE WORKSPACE DELAYS...`: as SPAWNER, but each server first forks a worker that
# holds every descriptor of the server's for 3 s and then exits, as a worker forked without exec would, or one of a
# server's threads still exiting: the lifeline pipe outlives the process that started the sandbox.
LINGERING = SPAWNER.replace("""    child = os.fork()
    if child == 0:
""", """    child = os.fork()
    if child == 0:
        from sciproto.processes import lifeline_fd
        lifeline_fd()
        if os.fork() == 0:
            import time
            time.sleep(3)
            os._exit(0)
""")


@pytest.mark.parametrize("mode", [pytest.param("bwrap", marks=needs_bwrap), "none"])
def test_a_sandbox_whose_server_died_as_it_started_ends_though_the_lifeline_lingers(workspace: Path, mode: str) -> None:
    """The lifeline pipe closes only when every holder of its write end has ended; the server's death must end the
    command (`none`) or, at the latest, the lifeline's end must end the whole sandbox (`bwrap`, whose parent-death
    ties are set part way through its set-up), whenever in the start the server died."""
    assert "lifeline_fd()" in LINGERING
    delays = [i * 0.001 for i in range(12)]
    subprocess.run([sys.executable, "-c", LINGERING, mode, str(workspace), *map(str, delays)], check=True,
                   timeout=120, cwd=Path(__file__).resolve().parents[2])
    left = _left_running(workspace, wait_s=60)  # the workers end after 3 s; a loaded machine may take longer
    assert left == [], f"{len(left)} sandbox processes outlived the server and its lifeline: {left[:5]}"


def _left_running(workspace: Path, wait_s: float) -> list[tuple[int, str, str]]:
    """The processes of sandboxes in `workspace` still running after up to `wait_s` seconds (killed, then
    returned with their state and command line for a failure message)."""

    def inside(pid: int) -> bool:
        return str(workspace) in _cmdline(pid) or (_cwd(pid) or "").startswith(str(workspace))

    deadline = time.monotonic() + wait_s
    while (left := [pid for pid in _pids() if inside(pid) and _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    seen = [(pid, _stat(pid), _cmdline(pid)[:300]) for pid in left]
    for pid in left:
        os.kill(pid, 9)
    return seen


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""

def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _cwd(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None


def _stat(pid: int) -> str:
    """State, parent pid, process group and session (from /proc/PID/stat), for a failure message."""
    try:
        return " ".join(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:4])
    except OSError:
        return "gone"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("mode", [pytest.param("bwrap", marks=needs_bwrap), "none"])
async def test_kernel_cpu_budget_output_cap_and_death(workspace: Path, mode: str) -> None:
    sandbox = Sandbox(workspace, SandboxLimits(), mode)  # type: ignore[arg-type]
    kernel = await SandboxedKernel.start(sandbox)
    try:
        spin = await kernel.run_cell("while True:\n    pass", CellLimits(wall_s=60, cpu_s=1, max_output_chars=1000))
        after = await kernel.run_cell("x = 6 * 7\nprint(x)", CellLimits(wall_s=30, cpu_s=30, max_output_chars=1000))
        loud = await kernel.run_cell("print('y' * 5000)", CellLimits(wall_s=30, cpu_s=30, max_output_chars=1000))
        died = await kernel.run_cell("import os\nos._exit(3)", CellLimits(wall_s=30, cpu_s=30, max_output_chars=1000))
        fresh = await kernel.run_cell("print('x' in dir())", CellLimits(wall_s=30, cpu_s=30, max_output_chars=1000))
    finally:
        await kernel.stop()
        sandbox.remove()
    assert spin.stopped is not None and "CPU time limit of 1 s" in spin.stopped and not spin.restarted
    assert [o["text"] for o in after.outputs] == ["42\n"]
    assert loud.outputs[0]["text"] == "y" * 1000 and "output cut" in loud.outputs[-1]["text"]
    assert died.stopped is not None and "exit status 3" in died.stopped and died.restarted
    assert [o["text"] for o in fresh.outputs] == ["False\n"]  # a fresh kernel: x is gone


@needs_bwrap
async def test_a_workspace_over_its_limit_ends_the_episode() -> None:
    source = load_source("notebook", {"workspace_mb": "1"})
    env = await source.make("test", 0)
    await env.reset()
    try:
        code = "for i in range(3):\n    open(f'fill{i}.bin', 'wb').write(b'x' * 500_000)"
        observations, reward, done, _ = await env.step(_edit_cell(code))
    finally:
        await env.close()
    assert done and reward == 0.0
    assert "more than its limit of 1 MiB" in observations[0].content


def _edit_cell(code: str) -> ToolRequestMessage:
    return ToolRequestMessage(tool_calls=[ToolCall.from_name("edit_cell", contents=code)])


def test_the_server_refuses_the_notebook_env_without_bwrap_and_names_the_fix(tmp_path: Path) -> None:
    # A PATH with this interpreter and nothing else: no bwrap.
    (tmp_path / "python").symlink_to(sys.executable)
    environment = {**os.environ, "PATH": str(tmp_path)}
    result = subprocess.run(sciproto_command("serve", "env", "--env", "notebook", "--port", "0"),
                            env=environment, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2, result.stderr
    assert "bubblewrap" in result.stderr and "sandbox: none" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@pytest.fixture(scope="module")
def unsandboxed_server() -> Iterator[ServerProcess]:
    yield from serve_env("sandbox-none", "envs=[notebook]", "env_options.notebook.sandbox=none")


async def test_sandbox_none_is_a_warning_at_start_and_shown_in_describe(unsandboxed_server: ServerProcess) -> None:
    async with EnvClient(unsandboxed_server.target) as client:
        described = await client.describe()
    description = {env.name: env.description for env in described.environments}["notebook"]
    assert "sandbox: none" in description and "unsandboxed" in description
    assert any("sandbox: none: agent code runs unsandboxed" in line for line in unsandboxed_server.output)


def _venv_under_tmp(root: Path) -> Path:
    """A virtual environment under /tmp (as on CI runners) whose packages are this one's: a
    .pth file names this interpreter's site-packages. Returns its python."""
    venv = root / "venv"
    subprocess.run([sys.executable, "-c", "import sys, venv; venv.create(sys.argv[1], with_pip=False)", str(venv)],
                   env={**os.environ, "PATH": str(Path(sys.base_prefix) / "bin") + ":" + os.environ["PATH"]},
                   check=True, timeout=120)
    python = venv / "bin" / "python"
    target = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                            capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    ours = [p for p in site.getsitepackages() if Path(p).is_dir()]
    repo = Path(__file__).resolve().parents[2]
    (Path(target) / "ours.pth").write_text("\n".join([*ours, str(repo)]) + "\n")
    return python


@needs_bwrap
async def test_a_server_running_from_a_venv_under_tmp_resets_sandboxed_notebook_episodes() -> None:
    root = Path(tempfile.mkdtemp(prefix="sciproto-venv-test-", dir="/tmp"))
    try:
        python = _venv_under_tmp(root)
        assert str(python).startswith("/tmp/")
        server = start_command([str(python), "-m", "sciproto", "serve", "env", "--env", "notebook",
                                "--port", "0"], timeout_s=120)
        try:
            async with EnvClient(server.target) as client:
                reset = await client.reset("notebook", split="test", index=0, timeout=120)
                step = await client.step(reset.episode_id, tool_calls_action(("edit_cell", {"contents": "print(6 * 7)"})),
                                         timeout=120)
                await client.close(reset.episode_id)
        finally:
            server.stop(grace_s=15)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert "42" in "\n".join(message.content for message in step.observations)


@needs_bwrap
async def test_a_kernel_that_exits_before_it_is_ready_says_why(workspace: Path) -> None:
    sandbox = Sandbox(workspace, SandboxLimits())
    # An interpreter with a module that fails at import in place of ipykernel_launcher.
    (workspace / "ipykernel_launcher.py").write_text("raise SystemExit('no kernel here: ' + 'broken on purpose')\n")
    try:
        with pytest.raises(RuntimeError) as raised:
            await SandboxedKernel.start(sandbox)
    finally:
        sandbox.remove()
    assert "before it was ready" in str(raised.value)
    assert "no kernel here: broken on purpose" in str(raised.value), str(raised.value)


async def test_a_kernel_dropped_without_stop_is_closed_by_the_collector(workspace: Path) -> None:
    """A kernel whose owner lost it (an episode that was never closed) must not take its process
    with it: its ZeroMQ context used to reach the garbage collector with the client's sockets
    still open, and the collector then blocked the server's thread in the context's term()."""
    import gc
    import threading
    import weakref

    sandbox = Sandbox(workspace, SandboxLimits(), "none")
    kernel = await SandboxedKernel.start(sandbox)
    pid = kernel.process.process.pid
    context = weakref.ref(kernel.client.context)
    del kernel
    collected = threading.Event()
    threading.Thread(target=lambda: (gc.collect(), collected.set()), daemon=True).start()
    assert await asyncio.to_thread(collected.wait, 60), "the garbage collector blocked on the kernel's context"
    assert context() is None or context().closed
    for _ in range(100):  # the finalizer's SIGKILL lands at once; reaping it may take a moment
        if not _alive(pid):
            break
        await asyncio.sleep(0.1)
    assert not _alive(pid), "the dropped kernel's process is still running"
    sandbox.remove()
