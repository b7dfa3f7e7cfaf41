"""`sciproto serve env --workers N`: N env server processes, one port each, for N cores.

Each worker is a whole `sciproto serve env` with its own episodes; a client spreads episodes over
the workers' addresses (`sciproto.client.replicas.ReplicaPool`, as `sciproto collect --env A --env B`
does) and keeps each episode on the worker that opened it. Ports: `--port P` gives the workers
P, P+1, ..., P+N-1; `--port 0` lets each pick a free one. Once every worker listens this
process prints

    SCIPROTO_WORKERS env ports=P1,P2,...
    SCIPROTO_READY env port=P1

Workers die with this process (its lifeline pipe, as every server `sciproto` starts), SIGTERM/SIGINT here drains all of them, and a
worker that exits ends the others too, with its exit status: whatever supervises this process
restarts the group.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from env_servers.app import load_settings
from sciproto.config import ConfigError
from sciproto.processes import READY, lifeline_popen_options, sciproto_command

START_TIMEOUT_S = 120.0  # for one worker to load its environments and listen


class Worker:
    def __init__(self, index: int, command: list[str]) -> None:
        self.index = index
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        **lifeline_popen_options())
        self.port: int | None = None
        self.ready = threading.Event()
        threading.Thread(target=self._pump, name=f"worker {index} output", daemon=True).start()

    def _pump(self) -> None:
        """Copy the worker's output here, each line marked with its worker; note its port."""
        assert self.process.stdout is not None
        for line in self.process.stdout:
            match = READY.search(line)
            if match and self.port is None:
                self.port = int(match.group(2))
                self.ready.set()
                continue  # only the group announces itself
            sys.stdout.write(f"[worker {self.index}] {line}")
            sys.stdout.flush()
        self.ready.set()

    def stop(self, grace_s: float) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


def worker_command(config: str | None, overrides: Sequence[str], port: int, verbose: bool) -> list[str]:
    command = sciproto_command("serve", "env", "--workers", "1")
    if config is not None:
        command += ["--config", config]
    for override in [*overrides, f"server.port={port}"]:  # the worker's port wins over the group's
        command += ["--set", override]
    return command + (["--verbose"] if verbose else [])


def main(config: str | None, overrides: list[str], workers: int, verbose: bool = False) -> None:
    try:
        settings = load_settings(config, overrides)  # bad settings fail here, once, not in N workers
        settings.auth.load()
    except ConfigError as error:
        print(f"sciproto serve env: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    base = settings.server.port
    group = [Worker(i, worker_command(config, overrides, base + i if base else 0, verbose)) for i in range(workers)]
    stopping = threading.Event()
    status = 0

    def stop_all(*_: object) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, stop_all)
    signal.signal(signal.SIGINT, stop_all)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        for worker in group:
            while not worker.ready.wait(0.1):
                if stopping.is_set() or time.monotonic() > deadline:
                    print(f"sciproto serve env: worker {worker.index} did not listen within"
                          f" {START_TIMEOUT_S:g} s", file=sys.stderr)
                    raise SystemExit(1)
            if worker.port is None:
                print(f"sciproto serve env: worker {worker.index} exited with {worker.process.wait()}"
                      " before listening (its output is above)", file=sys.stderr)
                raise SystemExit(1)
        ports = [worker.port for worker in group]
        print(f"SCIPROTO_WORKERS env ports={','.join(map(str, ports))}", flush=True)
        print(f"SCIPROTO_READY env port={ports[0]}", flush=True)
        while not stopping.wait(0.2):
            exited = next((w for w in group if w.process.poll() is not None), None)
            if exited is not None:
                status = exited.process.returncode or 1
                print(f"sciproto serve env: worker {exited.index} (port {exited.port}) exited with"
                      f" {exited.process.returncode}; stopping the others", file=sys.stderr)
                break
    finally:
        for worker in group:
            if worker.process.poll() is None:
                worker.process.send_signal(signal.SIGTERM)
        for worker in group:
            worker.stop(settings.server.grace_period_s + 5)
    raise SystemExit(status)
