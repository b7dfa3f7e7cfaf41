"""How the runs of an external agent program start: a new process each (any program), or, for a
Python program whose imports cost more than its run, forks of a fork server that imported them once
(`preload`; clients/agent_zygote.py, started with the agent's own interpreter).

Either way a run is a process of its own with its own environment, graded on its exit status: 0 is
a finished run, anything else raises with the last lines of its stderr. A run never outlives the
call that started it (a timeout or a cancellation kills it and waits for it), and the fork server
never outlives its user (it is stopped on exit, and it dies with its parent).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shlex
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Self

__all__ = ["AgentProgram", "AgentStartError", "Launch", "check_preload", "launcher"]

log = logging.getLogger(__name__)

ZYGOTE = Path(__file__).with_name("agent_zygote.py")
# A fork server that exits is started again, at most this many times in all; past that its runs fail.
FORK_SERVER_RESTARTS = 3
FORK_SERVER_READY_S = 120.0  # its imports may be slow on a loaded machine
KILL_WAIT_S = 30.0
# A run that imports at least this many modules the fork server had not imported is worth a
# warning (once): every run pays for those imports again.
LATE_IMPORTS_WARNING = 20

# One run: (the environment added to this process's, a label for errors) -> None; raises on failure.
Launch = Callable[[Mapping[str, str]], Awaitable[None]]


class AgentStartError(RuntimeError):
    """The fork server did not start (an import failed, or it was not ready in time)."""


@dataclass(frozen=True)
class AgentProgram:
    """The command line of an agent program (shell words), how long one run may take, and the
    Python modules to import once in a fork server (empty: each run is a new process)."""

    command: str
    timeout_s: float = 600.0
    preload: tuple[str, ...] = ()

    def argv(self) -> list[str]:
        argv = shlex.split(self.command)
        if not argv:
            raise ValueError("the agent command is empty")
        if self.preload and (len(argv) < 2 or argv[1].startswith("-") and (argv[1] != "-m" or len(argv) < 3)):
            raise ValueError(f"the agent command {self.command!r} with preload must be `PYTHON SCRIPT [ARGS]` or "
                             "`PYTHON -m MODULE [ARGS]` (no interpreter options): its runs are forks of a Python "
                             "fork server")
        return argv


@contextlib.asynccontextmanager
async def launcher(program: AgentProgram) -> AsyncIterator[Launch]:
    """Start runs of `program`: `await launch(env)` is one run with `env` added to its environment."""
    if not program.preload:
        async def spawn(env: Mapping[str, str]) -> None:
            await _spawn(program, env)

        yield spawn
        return
    async with ForkServer(program) as server:
        yield server.run


async def check_preload(program: AgentProgram) -> None:
    """Start `program`'s fork server and stop it: raises AgentStartError, with the reason, where
    its interpreter cannot import the preload (checked before a run starts anything else)."""
    if program.preload:
        async with ForkServer(program):
            pass


async def _spawn(program: AgentProgram, env: Mapping[str, str]) -> None:
    """One run as a new process. Its stderr goes to a file, not a pipe: a pipe's transport can
    still be open when the caller's event loop closes right after a cancelled run, which asyncio
    reports as errors at exit."""
    with tempfile.TemporaryFile() as stderr:
        starting = asyncio.ensure_future(asyncio.create_subprocess_exec(
            *program.argv(), stdout=asyncio.subprocess.DEVNULL, stderr=stderr, env={**os.environ, **env}))
        try:
            process = await asyncio.shield(starting)
        except asyncio.CancelledError:  # cancelled while the process started: it must not outlive us,
            # even when cancelled again meanwhile (awaiting `starting` itself would cancel the start
            # after the fork, leaving the process unwaited)
            await _wait_through_cancellation(starting, KILL_WAIT_S)
            if starting.done() and not starting.cancelled() and starting.exception() is None:
                await kill_and_wait(starting.result())
            raise
        try:
            await asyncio.wait_for(process.wait(), program.timeout_s)
        except TimeoutError:
            raise RuntimeError(f"the agent ran past {program.timeout_s:.0f} s") from None
        finally:
            if process.returncode is None:
                await kill_and_wait(process)
        if process.returncode != 0:
            raise RuntimeError(f"the agent exited {process.returncode}: {' | '.join(last_lines(stderr, 3))}")


async def kill_and_wait(process: asyncio.subprocess.Process, wait_s: float = KILL_WAIT_S) -> None:
    """Kill `process` and wait (at most `wait_s`) until it has exited; a second cancellation does
    not cut the wait short (a killed process exits at once)."""
    with contextlib.suppress(ProcessLookupError):
        process.kill()
    await _wait_through_cancellation(asyncio.ensure_future(process.wait()), wait_s)


async def _wait_through_cancellation(waiting: asyncio.Future[Any], wait_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while not waiting.done() and loop.time() < deadline:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait({waiting}, timeout=deadline - loop.time())


def last_lines(file: IO[bytes], count: int, window: int = 8192) -> list[str]:
    """The last `count` non-empty lines of `file` (read from its last `window` bytes)."""
    size = file.seek(0, os.SEEK_END)
    file.seek(max(0, size - window))
    lines = file.read().decode(errors="replace").splitlines()
    return [line for line in lines if line.strip()][-count:]


class ForkServer:
    """clients/agent_zygote.py under the agent's interpreter, with `program.preload` imported; each
    run is a fork of it that runs the program's script as `__main__`."""

    def __init__(self, program: AgentProgram) -> None:
        argv = program.argv()
        self.program, self.interpreter, self.run_argv = program, argv[0], argv[1:]
        self._process: asyncio.subprocess.Process | None = None
        self._stderr: IO[bytes] | None = None
        self._reader: asyncio.Task[None] | None = None
        self._runs: dict[int, asyncio.Future[int]] = {}
        # Each run's stderr file, by name until the server has opened it for the run (its "started"):
        # then the name goes, so a process killed mid-run leaves no file behind.
        self._stderr_names: dict[int, str] = {}
        self._next_id = 0
        self._starts = 0
        self._lock = asyncio.Lock()
        self._closed = False
        # Modules runs imported after the fork (the first few a run names, none inside another) -> how many runs did.
        self.late_imports: dict[str, int] = {}
        self._warned = False

    async def __aenter__(self) -> Self:
        await self._ensure_started()  # a program that cannot start fails here, once, with its reason
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._closed = True
        await self._stop()

    async def _ensure_started(self) -> asyncio.subprocess.Process:
        async with self._lock:
            if self._process is not None and self._reader is not None and not self._reader.done():
                return self._process
            if self._closed:
                raise RuntimeError("the agent fork server is closed")
            await self._stop()
            if self._starts > FORK_SERVER_RESTARTS:
                raise RuntimeError(f"the agent fork server exited {self._starts} times; no more runs start")
            self._starts += 1
            run0 = self.run_argv[0]
            path0 = os.getcwd() if run0 == "-m" else os.path.dirname(os.path.abspath(run0))
            self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - held as long as the server runs
            self._process = await asyncio.create_subprocess_exec(
                self.interpreter, str(ZYGOTE), path0, *self.program.preload, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=self._stderr, limit=1 << 20)
            try:
                line = await asyncio.wait_for(self._process.stdout.readline(), FORK_SERVER_READY_S)
            except TimeoutError:
                await self._stop()
                raise AgentStartError(f"the agent fork server was not ready in {FORK_SERVER_READY_S:.0f} s "
                                   f"(importing {', '.join(self.program.preload)})") from None
            message = _message(line)
            if not message.get("ready"):
                reason = message.get("error") or " | ".join(last_lines(self._stderr, 3)) or "no reason given"
                await self._stop()
                raise AgentStartError(f"the agent fork server ({self.interpreter}) did not start: {reason}")
            self._reader = asyncio.create_task(self._read(self._process))
            return self._process

    async def _read(self, process: asyncio.subprocess.Process) -> None:
        """Settle each run's future with its exit code; when the server's output ends, fail the
        runs it had (their processes died with it)."""
        assert process.stdout is not None
        try:
            while line := await process.stdout.readline():
                message = _message(line)
                if "imported" in message:
                    self._imported_late(int(message["count"]), message["modules"])
                    continue
                if "started" in message:
                    name = self._stderr_names.pop(message["started"], None)
                    if name is not None:
                        with contextlib.suppress(OSError):
                            os.unlink(name)
                    continue
                future = self._runs.get(message.get("exited", -1))
                if future is not None and not future.done():
                    if "error" in message:
                        future.set_exception(RuntimeError(f"the agent did not start: {message['error']}"))
                    else:
                        future.set_result(int(message["code"]))
        finally:
            reason = " | ".join(last_lines(self._stderr, 3)) if self._stderr else ""
            for future in self._runs.values():
                if not future.done():
                    future.set_exception(RuntimeError(f"the agent fork server exited during the run: "
                                                      f"{reason or 'no reason given'}"))

    def _imported_late(self, count: int, modules: list[str]) -> None:
        for module in modules:
            self.late_imports[module] = self.late_imports.get(module, 0) + 1
        if count >= LATE_IMPORTS_WARNING and not self._warned:
            self._warned = True
            log.warning("a run of the agent imported %d modules after the fork that preload had not (%s): add them to "
                        "preload (rollout.agent.preload, or agent-collect --preload) to import them once",
                        count, ", ".join(modules) or "too many to name")

    async def run(self, env: Mapping[str, str]) -> None:
        process = await self._ensure_started()
        assert process.stdin is not None
        run_id, self._next_id = self._next_id, self._next_id + 1
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._runs[run_id] = future
        fd, stderr_path = tempfile.mkstemp(prefix="sciproto-agent-", suffix=".stderr")
        stderr = os.fdopen(fd, "rb")
        self._stderr_names[run_id] = stderr_path
        try:
            if process.stdin.is_closing():
                raise RuntimeError("the agent fork server exited before the run started")
            process.stdin.write(json.dumps({"run": run_id, "argv": self.run_argv, "env": {**os.environ, **env},
                                            "cwd": os.getcwd(), "stderr": stderr_path}).encode() + b"\n")
            try:
                code = await asyncio.wait_for(asyncio.shield(future), self.program.timeout_s)
            except TimeoutError:
                raise RuntimeError(f"the agent ran past {self.program.timeout_s:.0f} s") from None
            finally:
                if not future.done():  # timed out or cancelled: kill the run and wait for its end
                    with contextlib.suppress(Exception):
                        process.stdin.write(json.dumps({"kill": run_id}).encode() + b"\n")
                    await _wait_through_cancellation(future, KILL_WAIT_S)
            if code != 0:
                tail = await asyncio.to_thread(last_lines, stderr, 3)
                raise RuntimeError(f"the agent exited {code}: {' | '.join(tail)}")
        finally:
            self._runs.pop(run_id, None)
            stderr.close()
            if self._stderr_names.pop(run_id, None) is not None:  # never started
                with contextlib.suppress(OSError):
                    os.unlink(stderr_path)

    async def _stop(self) -> None:
        """Close the server's stdin (it kills its runs and exits), kill it if it does not."""
        process, self._process = self._process, None
        if process is not None:
            if process.stdin is not None:
                process.stdin.close()
            await _wait_through_cancellation(asyncio.ensure_future(process.wait()), 10.0)
            if process.returncode is None:
                await kill_and_wait(process)
        if self._reader is not None:
            await _wait_through_cancellation(self._reader, KILL_WAIT_S)
            self._reader = None
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None


def _message(line: bytes) -> dict[str, Any]:
    try:
        message = json.loads(line)
    except ValueError:
        return {}
    return message if isinstance(message, dict) else {}
