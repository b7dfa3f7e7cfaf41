"""Start sciproto servers as child processes and wait until they listen.

Used by `sciproto train` (which runs every component locally) and by the tests
(which always talk to real servers in separate processes).
"""

from __future__ import annotations

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


class ServerStartError(RuntimeError):
    """A server process exited or stayed silent instead of announcing its port."""


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
        """SIGTERM (graceful drain), then SIGKILL after `grace_s`."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL: no drain, as a crash would."""
        if self.alive():
            self.process.kill()
            self.process.wait(timeout=10)


def sciproto_command(*args: str) -> list[str]:
    """The command line that runs `sciproto ARGS` with this interpreter."""
    return [sys.executable, "-m", "sciproto", *args]


def start_server(args: Sequence[str], **options: Any) -> ServerProcess:
    """Run `sciproto ARGS` (e.g. ["serve", "env", "--port", "0"]) and return
    once it listens; options as for `start_command`."""
    return start_command(sciproto_command(*args), **options)


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
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True", **(env or {})}
    process = subprocess.Popen(
        list(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=full_env, cwd=cwd, start_new_session=True,
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
    threading.Thread(target=pump, name=f"output:{shown}", daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not announced.wait(0.1):
        if time.monotonic() > deadline:
            process.kill()
            raise ServerStartError(f"`{shown}` did not announce a port within {timeout_s:.0f} s:\n"
                                   + "\n".join(output))
    if "port" not in ready:
        process.wait(timeout=10)
        raise ServerStartError(f"`{shown}` exited with {process.returncode}:\n" + "\n".join(output))
    return ServerProcess(component=ready["component"], process=process, port=int(ready["port"]), output=output)
