"""Start sciproto servers as child processes and wait until they listen.

Used by `sciproto train` (which runs every component locally) and by the tests
(which always talk to real servers in separate processes).

No child outlives this process, whatever ends it (Ctrl-C twice, SIGKILL, a
closed terminal): every child gets the read end of one *lifeline* pipe whose
write end only this process holds. The kernel closes that end when this process
dies, the child's `watch_parent()` thread reads end-of-file, and the child
stops itself: SIGTERM (the servers drain and the learner saves its checkpoint),
then SIGKILL to its whole process group after a grace period. A pipe, unlike
prctl's parent-death signal, is tied to the process and not to the thread that
started the child (`sciproto train` starts servers from worker threads), and it
cannot be missed: a child that looks after its parent is gone reads
end-of-file at once. Each child leads its own process group (a Ctrl-C at the
terminal reaches only the parent, which stops its children in order), and a
kill takes the whole group, so helpers a server started go with it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

READY = re.compile(r"SCIPROTO_READY (\S+) port=(\d+)")
LIFELINE_ENV = "SCIPROTO_LIFELINE_FD"  # the inherited read end of the lifeline pipe
LIFELINE_GRACE_ENV = "SCIPROTO_LIFELINE_GRACE_S"  # SIGTERM to SIGKILL once the parent is gone
DEFAULT_LIFELINE_GRACE_S = 30.0

_lifeline_lock = threading.Lock()
_lifeline: tuple[int, int] | None = None  # (read, write); the write end is never closed here


def lifeline_fd() -> int:
    """The read end of this process's lifeline pipe, made on first use. Both ends are
    non-inheritable: a child gets the read end only through `pass_fds`."""
    global _lifeline
    with _lifeline_lock:
        if _lifeline is None:
            _lifeline = os.pipe()
        return _lifeline[0]


def watch_parent() -> None:
    """In a process started by `start_command`: stop once the parent is gone (see the module
    docstring). Does nothing in a process started otherwise."""
    raw = os.environ.pop(LIFELINE_ENV, None)
    if raw is None:
        return
    fd = int(raw)
    grace_s = float(os.environ.pop(LIFELINE_GRACE_ENV, DEFAULT_LIFELINE_GRACE_S))
    os.set_inheritable(fd, False)  # this process's own children have their own lifeline

    def watch() -> None:
        try:
            while os.read(fd, 1):  # nothing is ever written: this returns at end-of-file
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="lifeline", daemon=True).start()


class ServerStartError(RuntimeError):
    """A server process exited or stayed silent instead of announcing its port. The message
    holds its last 200 lines of output; `headline` only the last one, where a sciproto server
    says in one line what is wrong (what `sciproto train` shows)."""

    def __init__(self, message: str, output: Sequence[str]) -> None:
        self.output = list(output)
        last = next((line.strip() for line in reversed(self.output) if line.strip()), "")
        self.headline = f"{message}: {last}" if last else message
        super().__init__(f"{message}:\n" + "\n".join(self.output))


@dataclass
class ServerProcess:
    """A running server child process and the last lines it printed."""

    component: str
    process: subprocess.Popen[str]
    port: int
    host: str = "127.0.0.1"
    output: deque[str] = field(default_factory=lambda: deque(maxlen=200))

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace_s: float = 15.0) -> int:
        """SIGTERM (graceful drain), then SIGKILL to its process group after `grace_s`."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.kill()
        _kill_group(self.process.pid)  # whatever the server started and left behind
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL to the server and its process group: no drain, as a crash would."""
        if self.alive():
            _kill_group(self.process.pid)
            self.process.kill()
            self.process.wait(timeout=10)


def _kill_group(pid: int) -> None:
    """SIGKILL the process group `pid` leads (children start in their own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def sciproto_command(*args: str) -> list[str]:
    """The command line that runs `sciproto ARGS` with this interpreter."""
    return [sys.executable, "-m", "sciproto", *args]


def start_server(args: Sequence[str], **options: Any) -> ServerProcess:
    """Run `sciproto ARGS` (e.g. ["serve", "env", "--port", "0"]) and return
    once it listens; options as for `start_command`."""
    return start_command(sciproto_command(*args), **options)


def lifeline_popen_options() -> dict[str, Any]:
    """`subprocess.Popen` keywords that hand a child this process's lifeline: a child running the
    sciproto CLI (`watch_parent`) then stops when this process is gone, however it dies."""
    lifeline = lifeline_fd()
    return {"env": {**os.environ, LIFELINE_ENV: str(lifeline)}, "pass_fds": (lifeline,)}


def start_command(
    command: Sequence[str],
    *,
    timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    log_file: Path | None = None,
) -> ServerProcess:
    """Run a server command and return once it prints its SCIPROTO_READY
    line. Output is kept (last 200 lines) and, when `log_file` is given,
    copied there."""
    lifeline = lifeline_popen_options()
    full_env = {**lifeline["env"], "PYTHONUNBUFFERED": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                **(env or {})}
    process = subprocess.Popen(
        list(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=full_env, cwd=cwd, start_new_session=True, pass_fds=lifeline["pass_fds"],
    )
    output: deque[str] = deque(maxlen=200)
    ready: dict[str, str] = {}
    announced = threading.Event()

    def pump() -> None:
        sink = log_file.open("a") if log_file else None
        assert process.stdout is not None
        for line in process.stdout:
            output.append(line.rstrip("\n"))
            if sink:
                sink.write(line)
                sink.flush()
            match = READY.search(line)
            if match and not announced.is_set():
                ready.update(component=match.group(1), port=match.group(2))
                announced.set()
        if sink:
            sink.close()
        announced.set()

    shown = " ".join(command[2:5])
    where = f" (output in {log_file})" if log_file else ""
    threading.Thread(target=pump, name=f"output:{shown}", daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not announced.wait(0.1):
        if time.monotonic() > deadline:
            _kill_group(process.pid)
            process.kill()
            raise ServerStartError(f"`{shown}` did not announce a port within {timeout_s:.0f} s{where}",
                                   output)
    if "port" not in ready:
        process.wait(timeout=10)
        raise ServerStartError(f"`{shown}` exited with {process.returncode}{where}", output)
    return ServerProcess(component=ready["component"], process=process, port=int(ready["port"]), output=output)
