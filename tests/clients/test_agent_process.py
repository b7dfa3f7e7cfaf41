"""How the runs of an external agent program start (clients.agent_process): a new process each, or
forks of a fork server that imported the program's modules once. Real processes: the fork server
is started with this interpreter and runs real scripts."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from clients.agent_process import ZYGOTE, AgentProgram, AgentStartError, ForkServer, launcher

pytestmark = pytest.mark.timeout(120)

# A run reports what it saw: its argv, __name__, sys.path[0], environment, pid, and whether a
# module-level mark left by an earlier run in the same interpreter is there.
SCRIPT = """\
import json, os, sys, time
print("a line on stderr", file=sys.stderr)
seen = getattr(json, "_left_by_a_run", None)
json._left_by_a_run = os.getpid()
with open(os.environ["OUT"], "w") as out:
    json.dump({"argv": sys.argv, "name": __name__, "path0": sys.path[0], "task": os.environ.get("TASK"),
               "pid": os.getpid(), "seen": seen, "cwd": os.getcwd()}, out)
time.sleep(float(os.environ.get("SLEEP", "0")))
if os.environ.get("FAIL"):
    raise ValueError("the agent's own error")
sys.exit(int(os.environ.get("CODE", "0")))
"""


def program(tmp_path: Path, *, preload: tuple[str, ...] = ("json",), timeout_s: float = 60.0) -> AgentProgram:
    script = tmp_path / "agent.py"
    script.write_text(SCRIPT)
    return AgentProgram(f"{sys.executable} {script} --flag value", timeout_s, preload)


def report(path: Path) -> dict:
    return json.loads(path.read_text())


def gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("preload", [(), ("json",)], ids=["process", "fork-server"])
def test_a_run_is_the_script_as_main_with_its_own_environment(tmp_path: Path, preload: tuple[str, ...]) -> None:
    async def main() -> list[dict]:
        async with launcher(program(tmp_path, preload=preload)) as launch:
            await asyncio.gather(*(launch({"OUT": str(tmp_path / f"run{i}.json"), "TASK": f"task {i}"})
                                   for i in range(4)))
            await launch({"OUT": str(tmp_path / "run4.json"), "TASK": "task 4"})
        return [report(tmp_path / f"run{i}.json") for i in range(5)]

    runs = asyncio.run(main())
    for i, run in enumerate(runs):
        assert run["argv"] == [str(tmp_path / "agent.py"), "--flag", "value"]
        assert run["name"] == "__main__" and run["path0"] == str(tmp_path) and run["task"] == f"task {i}"
        assert run["cwd"] == os.getcwd()
        # Nothing one run leaves in its interpreter is seen by the next: each is a fresh fork.
        assert run["seen"] is None, run
    assert len({run["pid"] for run in runs}) == 5


@pytest.mark.parametrize("preload", [(), ("json",)], ids=["process", "fork-server"])
def test_a_failed_run_raises_with_its_exit_status_and_stderr(tmp_path: Path, preload: tuple[str, ...]) -> None:
    async def main() -> tuple[str, str]:
        async with launcher(program(tmp_path, preload=preload)) as launch:
            with pytest.raises(RuntimeError) as code:
                await launch({"OUT": str(tmp_path / "a.json"), "CODE": "3"})
            with pytest.raises(RuntimeError) as raised:
                await launch({"OUT": str(tmp_path / "b.json"), "FAIL": "1"})
            await launch({"OUT": str(tmp_path / "c.json")})  # the launcher still works
        return str(code.value), str(raised.value)

    code, raised = asyncio.run(main())
    assert code == "the agent exited 3: a line on stderr", code
    # The last lines of its traceback, as the interpreter prints it.
    assert raised.startswith("the agent exited 1: ") and raised.endswith("ValueError: the agent's own error"), raised
    assert 'agent.py", line 10, in <module>' in raised, raised


@pytest.mark.parametrize("preload", [(), ("json",)], ids=["process", "fork-server"])
def test_a_run_past_its_timeout_or_cancelled_is_killed(tmp_path: Path, preload: tuple[str, ...]) -> None:
    async def main() -> list[int]:
        async with launcher(program(tmp_path, preload=preload, timeout_s=2.0)) as launch:
            with pytest.raises(RuntimeError, match="the agent ran past 2 s"):
                await launch({"OUT": str(tmp_path / "slow.json"), "SLEEP": "600"})
            run = asyncio.ensure_future(launch({"OUT": str(tmp_path / "cancelled.json"), "SLEEP": "600"}))
            while not (tmp_path / "cancelled.json").exists():
                await asyncio.sleep(0.05)
            run.cancel()
            with pytest.raises(asyncio.CancelledError):
                await run
            return [report(tmp_path / name)["pid"] for name in ("slow.json", "cancelled.json")]

    for pid in asyncio.run(main()):
        assert gone(pid, within_s=1.0), f"run {pid} outlived its call"


def test_a_run_cancelled_twice_while_its_process_starts_leaves_no_process(tmp_path: Path) -> None:
    # A run's end cancels it, and the event loop's shutdown may cancel it again while it is still
    # waiting for its process to start: the process must still be killed and waited for, or it
    # outlives the run and asyncio complains once the loop is closed.
    marker = f"sciproto-twice-cancelled-{tmp_path.name}"
    agent = AgentProgram(f"{sys.executable} -c 'import time; time.sleep(600)' {marker}", 60.0)

    async def main(first: int, second: int) -> None:
        async with launcher(agent) as launch:
            run = asyncio.ensure_future(launch({}))
            for _ in range(first):  # the run asks for its process, which starts over a few loop turns
                await asyncio.sleep(0)
            run.cancel()
            for _ in range(second):  # it waits for the process, to kill it
                await asyncio.sleep(0)
            run.cancel()
            with pytest.raises(asyncio.CancelledError):
                await run

    for first in range(4):
        for second in range(6):
            asyncio.run(main(first, second))
            left = subprocess.run(["pgrep", "-f", marker], check=False, capture_output=True, text=True, timeout=30)
            subprocess.run(["pkill", "-f", marker], check=False, timeout=30)
            assert left.stdout == "", f"cancelled after {first} and {second} loop turns, its process outlived it"


def test_the_fork_server_imports_once_and_stops_with_its_runs(tmp_path: Path) -> None:
    async def main() -> tuple[int, int]:
        server = ForkServer(program(tmp_path))
        async with server:
            assert server._process is not None
            zygote = server._process.pid
            run = asyncio.ensure_future(server.run({"OUT": str(tmp_path / "long.json"), "SLEEP": "600"}))
            while not (tmp_path / "long.json").exists():
                await asyncio.sleep(0.05)
            child = report(tmp_path / "long.json")["pid"]
            assert psutil.Process(child).ppid() == zygote  # a fork of the server, not a new interpreter
            await server.__aexit__(None, None, None)
            with pytest.raises(RuntimeError, match="fork server exited during the run"):
                await run
        return zygote, child

    zygote, child = asyncio.run(main())
    assert gone(zygote) and gone(child)



def test_what_runs_import_after_the_fork_is_reported_with_the_modules_to_preload(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A package that imports its parts lazily (openai's API resources, on a client's first use)
    is not all preloaded by importing it: each run would import the rest again. The fork server
    says what runs imported after the fork, and the launcher warns once with the modules to add."""
    script = tmp_path / "agent.py"
    script.write_text("import email.mime.text\n")

    async def late_imports(preload: tuple[str, ...]) -> dict[str, int]:
        async with ForkServer(AgentProgram(f"{sys.executable} {script}", 60, preload)) as server:
            await server.run({})
            await server.run({})
            deadline = time.monotonic() + 10  # the report and the exit come on different pipes
            while sum(server.late_imports.values()) < 2 * (preload == ("json",)) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return server.late_imports

    with caplog.at_level(logging.WARNING, logger="clients.agent_process"):
        assert asyncio.run(late_imports(("json",)))["email"] == 2
    warnings = [record.getMessage() for record in caplog.records if "preload" in record.getMessage()]
    assert len(warnings) == 1 and "(email" in warnings[0] and "add them to preload" in warnings[0], warnings
    assert "email" not in asyncio.run(late_imports(("json", "email.mime.text")))

def test_a_run_dies_with_the_fork_server_and_the_next_run_starts_a_new_one(tmp_path: Path) -> None:
    async def main() -> tuple[int, int, int]:
        async with ForkServer(program(tmp_path)) as server:
            assert server._process is not None
            first = server._process.pid
            run = asyncio.ensure_future(server.run({"OUT": str(tmp_path / "long.json"), "SLEEP": "600"}))
            while not (tmp_path / "long.json").exists():
                await asyncio.sleep(0.05)
            os.kill(first, signal.SIGKILL)
            with pytest.raises(RuntimeError, match="the agent fork server exited during the run"):
                await run
            await server.run({"OUT": str(tmp_path / "after.json")})
            assert server._process is not None
            return first, server._process.pid, report(tmp_path / "long.json")["pid"]

    first, second, orphan = asyncio.run(main())
    assert second != first
    assert gone(orphan), "a run outlived its fork server"


def test_a_module_the_interpreter_lacks_stops_the_launcher_with_the_import_error(tmp_path: Path) -> None:
    async def main() -> None:
        async with launcher(program(tmp_path, preload=("json", "no_such_module_here"))):
            pass

    with pytest.raises(AgentStartError, match="import no_such_module_here failed: ModuleNotFoundError"):
        asyncio.run(main())


def test_preload_needs_a_python_script_or_module_command() -> None:
    assert AgentProgram("python -m my_agent --x 1", preload=("openai",)).argv()[1:3] == ["-m", "my_agent"]
    for command in ("python", "python -u agent.py", "python -m"):
        with pytest.raises(ValueError, match="with preload must be `PYTHON SCRIPT"):
            AgentProgram(command, preload=("openai",)).argv()


def test_nothing_outlives_a_killed_user_of_the_fork_server(tmp_path: Path) -> None:
    """SIGKILL the process that started the fork server, mid-run: the server sees its stdin close
    (and dies with its parent), and its runs die with it."""
    user = tmp_path / "user.py"
    user.write_text(f"""
import asyncio, json, sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
from clients.agent_process import AgentProgram, ForkServer

async def main():
    async with ForkServer(AgentProgram({f"{sys.executable} {tmp_path / 'agent.py'}"!r}, 600, ("json",))) as server:
        run = asyncio.ensure_future(server.run({{"OUT": {str(tmp_path / "long.json")!r}, "SLEEP": "600"}}))
        print(server._process.pid, flush=True)
        await run

asyncio.run(main())
""")
    (tmp_path / "agent.py").write_text(SCRIPT)
    temp = tmp_path / "tmp"  # the user's temporary directory: where a run's stderr would be left
    temp.mkdir()
    process = psutil.Popen([sys.executable, str(user)], stdout=-1, text=True, env={**os.environ, "TMPDIR": str(temp)})
    try:
        zygote = int(process.stdout.readline())
        deadline = time.monotonic() + 30
        while not (tmp_path / "long.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        child = report(tmp_path / "long.json")["pid"]
    finally:
        process.kill()
        process.wait(30)
    assert gone(zygote), "the fork server outlived the process that started it"
    assert gone(child), "a run outlived the fork server's user"
    # Nor does a file: the run's stderr is gone with the processes that held it.
    assert not list(temp.iterdir()), list(temp.iterdir())


def test_the_fork_server_refuses_a_run_whose_stderr_it_cannot_open_and_serves_the_next(tmp_path: Path) -> None:
    """The fork server's protocol, spoken directly: the run's stderr is opened before the fork, so a
    path it cannot open is answered at once and no child is made. That includes a file the parent
    made and has removed again (it gave up on the run before the server read the request): the
    server does not make it anew, which would leave it behind, nor run what nobody waits for."""
    (tmp_path / "agent.py").write_text(SCRIPT)
    (tmp_path / "stderr").touch()  # the parent makes each run's file (tempfile.mkstemp)
    zygote = subprocess.Popen([sys.executable, str(ZYGOTE), str(tmp_path), "json"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(zygote.stdout.readline()) == {"ready": True}
        base = {"argv": [str(tmp_path / "agent.py")], "cwd": str(tmp_path), "env": {**os.environ}}
        for run, stderr in ((0, "/no/such/dir/stderr"), (1, str(tmp_path / "stderr")), (2, str(tmp_path / "gone"))):
            request = {**base, "run": run, "stderr": stderr, "env": {**base["env"], "OUT": str(tmp_path / f"{run}.json")}}
            zygote.stdin.write(json.dumps(request) + "\n")
            zygote.stdin.flush()
        messages = [json.loads(zygote.stdout.readline()) for _ in range(4)]
        refused = [m for m in messages if "error" in m]
        assert [(m["exited"], m["code"]) for m in refused] == [(0, 1), (2, 1)], messages
        assert all("No such file" in m["error"] for m in refused), refused
        assert [m["started"] for m in messages if "started" in m] == [1], messages
        assert [m for m in messages if "exited" in m and "error" not in m] == [{"exited": 1, "code": 0}], messages
        assert (tmp_path / "stderr").read_text() == "a line on stderr\n"
        assert not (tmp_path / "0.json").exists() and not (tmp_path / "2.json").exists()
        assert not (tmp_path / "gone").exists(), "a removed stderr file was made anew"
    finally:
        zygote.stdin.close()
        zygote.wait(30)
