"""The several-machines guide's Ray recipe through Ray's own CLI: `ray start --head`, then `ray job
submit --working-dir . -- sciproto train --config demo --cluster ray`; the job succeeds at its step
budget. On loopback, so one node: Ray joins a second node only in its cluster mode, where a node's
address is the machine's own (the placement over several nodes is tested on a simulated cluster in
tests/clients/test_ray_engine.py). Ray's daemons detach from the command that starts them, so
`ray start` runs in a process group of its own, and the test ends every process of that group (and
their children) itself: `ray stop` would stop every Ray on the machine, not only this test's."""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guides" / "several-machines.md"
BIN = Path(sys.executable).parent

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs the sciproto[ray] extra"),
              pytest.mark.timeout(600)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def processes_of(groups: set[int]) -> set[int]:
    """Live processes in `groups`, and their descendants (a job's driver runs in a session of its own)."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, ppid, pgid = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if state != "Z":
            table[int(stat.parent.name)] = (int(ppid), int(pgid))
    found = {pid for pid, (_, pgid) in table.items() if pgid in groups}
    while more := {pid for pid, (ppid, _) in table.items() if ppid in found} - found:
        found |= more
    return found


def end(groups: set[int]) -> set[int]:
    """SIGTERM, then SIGKILL, to every process of `groups`; what is still alive after that."""
    for sig, grace_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        for pid in processes_of(groups):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while processes_of(groups) and time.monotonic() < deadline:
            time.sleep(0.2)
    return processes_of(groups)


def test_ray_start_and_ray_job_submit_train_the_demo(tmp_path: Path) -> None:
    # Ray's sockets live under its temp dir, whose path must stay short; private to this test.
    temp = Path(tempfile.mkdtemp(prefix="rayjob-", dir="/tmp"))
    port, dashboard = free_port(), free_port()
    # As on a node whose venv is active: `ray` and `sciproto` on PATH (the job's entrypoint runs
    # with the environment of `ray start`). Loopback only: Ray takes 127.0.0.1 as the node's address.
    # Token authentication on, with a token of this test's own, on every command (as the guide
    # says): `ray start --head` turns it on by itself when ~/.ray/auth_token exists (any earlier
    # ray.init() on the machine writes one), and `ray job submit` does not, so left to Ray the submit
    # is refused with 401 on such a machine.
    token = temp / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    env.pop("RAY_AUTH_TOKEN", None)
    groups: set[int] = set()

    def ray(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        process = subprocess.Popen([str(BIN / "ray"), *args], env=env, cwd=ROOT, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        groups.add(process.pid)
        out, _ = process.communicate(timeout=timeout_s)
        return subprocess.CompletedProcess(process.args, process.returncode, out, "")

    runs = tmp_path / "runs"
    try:
        head = ray("start", "--head", f"--port={port}", "--num-cpus=3", "--node-ip-address=127.0.0.1",
                   f"--dashboard-port={dashboard}", f"--temp-dir={temp}", "--disable-usage-stats")
        assert head.returncode == 0, head.stdout
        # 3 CPUs, one per server.
        job = ray("job", "submit", f"--address=http://127.0.0.1:{dashboard}", "--working-dir", ".", "--",
                  "sciproto", "train", "--config", "demo", "--cluster", "ray", "--set", f"run.dir={runs}",
                  "--set", "budget.max_steps=2", "--set", "progress=false", timeout_s=420)
        assert job.returncode == 0 and "succeeded" in job.stdout, job.stdout[-4000:]
    finally:
        left = end(groups)
        shutil.rmtree(temp, ignore_errors=True)
    assert not left, f"processes of this test's Ray outlived it: {sorted(left)}"
    summary = json.loads((runs / "demo" / "summary.json").read_text())
    assert [step["step"] for step in summary["steps"]] == [1, 2]
    # The guide gives the same commands (addresses, ports and sizes aside).
    guide = GUIDE.read_text()
    for command in ("export RAY_AUTH_MODE=token", "export RAY_AUTH_TOKEN_PATH=", "ray start --head --port", "ray start --address", "ray job submit --address http://127.0.0.1:",
                    "--working-dir . -- sciproto train --config demo --cluster ray --set run.dir=",
                    *[f"--set {role}.server.allow_insecure_remote=true" for role in ("env", "policy", "learner")]):
        assert command in guide, command
