"""The several-machines guide's Ray recipe through Ray's own CLI, two nodes on this machine: `ray
start --head`, a second node by `ray start --address` (ports of its own, on loopback), then `ray job
submit --working-dir . -- sciproto train --config demo --cluster ray`. Mid-run the second node's
raylet is killed by its PID while it hosts an env server: the actor comes back on the head (Ray
restarts it there) and the job still succeeds at its step budget.

Ray's cluster mode takes a node's address from its route to the outside; in the loopback-only
network namespace of scripts/test.sh that is 127.0.0.1, so both nodes join on loopback, and
nothing of Ray (its dashboard probes the cloud metadata address, `ray start` reports to Ray's usage
server) leaves the machine. Outside such a namespace the test skips (on CI it fails): it would not
be on loopback only. (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, which pins Ray to 127.0.0.1, also turns
its multi-node mode off: `ray start --address` then aborts.)

Ray's daemons detach from the command that starts them, so each `ray start` runs in a process group
of its own, and the test ends every process of those groups (and their children) itself: `ray stop`
would stop every Ray on the machine, not only this test's."""

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
from typing import Any

import pytest

from tests.conftest import LOOPBACK_ONLY

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


def ray_json(ray: Any, *args: str) -> list[dict[str, Any]]:
    result = ray(*args, "--format", "json", timeout_s=60)
    assert result.returncode == 0, result.stdout
    return json.loads(result.stdout[result.stdout.index("["):])


def test_two_nodes_by_ray_start_and_ray_job_submit_train_the_demo_through_a_lost_node(tmp_path: Path) -> None:
    if not LOOPBACK_ONLY:
        reason = "needs a loopback-only network namespace (scripts/test.sh runs the tests in one)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    # Ray's sockets live under its temp dir, whose path must stay short; private to this test.
    temp = Path(tempfile.mkdtemp(prefix="rayjob-", dir="/tmp"))
    port, dashboard = free_port(), free_port()
    # As on a node whose venv is active: `ray` and `sciproto` on PATH (the job's entrypoint runs
    # with the environment of `ray start`). Token authentication on, with a token of this test's
    # own, on every command (as the guide says): `ray start --head` turns it on by itself when
    # ~/.ray/auth_token exists (any earlier ray.init() on the machine writes one), and `ray job
    # submit` does not, so left to Ray the submit is refused with 401 on such a machine. The GCS
    # checks each node every second (Ray's default: 3 s), so a lost node is declared dead in ~6 s.
    token = temp / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_")},
           "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN_PATH": str(token), "RAY_health_check_period_ms": "1000"}
    groups: dict[str, int] = {}

    def ray(*args: str, timeout_s: float = 120, group: str = "") -> subprocess.CompletedProcess[str]:
        process = start(*args, group=group)
        out, _ = process.communicate(timeout=timeout_s)
        return subprocess.CompletedProcess(process.args, process.returncode, out, "")

    def start(*args: str, group: str = "") -> subprocess.Popen[str]:
        process = subprocess.Popen([str(BIN / "ray"), *args], env=env, cwd=ROOT, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        groups[group or str(process.pid)] = process.pid
        return process

    runs = tmp_path / "runs"
    metrics = runs / "demo" / "metrics.jsonl"
    dash = f"--address=http://127.0.0.1:{dashboard}"
    try:
        # The head: 2 CPUs and the `trainer` resource that pins the learner here (a lost learner
        # would stop the run); the second node: 1 CPU. Each node's agent ports are its own.
        head = ray("start", "--head", f"--port={port}", "--num-cpus=2", "--resources={\"trainer\": 1}",
                   f"--dashboard-port={dashboard}", f"--dashboard-agent-listen-port={free_port()}",
                   f"--temp-dir={temp}", "--disable-usage-stats", group="head")
        assert head.returncode == 0, head.stdout
        worker = ray("start", f"--address=127.0.0.1:{port}", "--num-cpus=1",
                     f"--dashboard-agent-listen-port={free_port()}", group="worker")
        assert worker.returncode == 0, worker.stdout
        second = next(node["node_id"] for node in ray_json(ray, "list", "nodes", dash) if not node["is_head_node"])
        # Half a CPU per server: two env servers spread over the two nodes, the policy and the
        # learner; all four fit on the head alone once the second node is gone.
        job = start("job", "submit", dash, "--working-dir", ".", "--",
                    "sciproto", "train", "--config", "demo", "--cluster", "ray", "--set", f"run.dir={runs}",
                    # 12 steps whatever the reward: the demo's target ended one run at step 9
                    "--set", "budget.max_steps=12", "--set", "budget.target_reward=null",
                    "--set", "progress=false", "--set", "cluster.env.replicas=2",
                    *[arg for role in ("env", "policy", "learner") for arg in ("--set", f"cluster.{role}.cpus=0.5")],
                    "--set", "cluster.learner.resources={trainer: 1}", group="job")
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().strip()) and job.poll() is None:
            assert time.monotonic() < deadline, "no training step within 300 s"
            time.sleep(0.5)
        assert job.poll() is None, job.communicate()[0][-4000:]
        # Step 1 is done: which servers does the second node host? Then kill its raylet. The run goes on
        # while `ray list` answers (2 steps here) and Ray restarts the lost actor ~8 s after the kill
        # (3 more): 12 steps leave it room to do so before the run ends (with 8, a run on a loaded machine
        # can end first, and its stop kills the lost actor before Ray restarts it).
        servers = ray_json(ray, "list", "actors", dash, "--filter", "class_name=ServerHost", "--filter", "state=ALIVE",
                           "--detail")
        lost = sorted(actor["actor_id"] for actor in servers if actor["node_id"] == second)
        roles = sorted(actor["repr_name"] or actor["actor_id"] for actor in servers if actor["node_id"] == second)
        assert lost, f"the second node hosts no server: {servers}"
        raylet = [pid for pid in processes_of({groups["worker"]})
                  if Path(f"/proc/{pid}/comm").read_text().strip() == "raylet"]
        assert len(raylet) == 1, raylet
        os.kill(raylet[0], signal.SIGKILL)
        out, _ = job.communicate(timeout=420)
        assert job.returncode == 0 and "succeeded" in out, f"lost {roles}\n{out[-4000:]}"
        after = {actor["actor_id"]: actor for actor in ray_json(ray, "list", "actors", dash, "--filter",
                                                                 "class_name=ServerHost", "--detail")}
    finally:
        left = end(set(groups.values()))
        shutil.rmtree(temp, ignore_errors=True)
    assert not left, f"processes of this test's Ray outlived it: {sorted(left)}"
    # Each server the lost node hosted was restarted by Ray (on the head, the only node left).
    assert all(after[actor]["num_restarts"] >= 1 for actor in lost), json.dumps(
        [{key: after[actor].get(key) for key in ("repr_name", "state", "num_restarts", "node_id", "death_cause")}
         for actor in lost], default=str)
    summary = json.loads((runs / "demo" / "summary.json").read_text())
    assert [step["step"] for step in summary["steps"]] == list(range(1, 13))
    # The guide gives the same commands (addresses, ports and sizes aside).
    guide = GUIDE.read_text()
    for command in ("export RAY_AUTH_MODE=token", "export RAY_AUTH_TOKEN_PATH=", "ray start --head --port",
                    "ray start --address", "ray job submit --address http://127.0.0.1:",
                    "--working-dir . -- sciproto train --config demo --cluster ray --set run.dir=",
                    *[f"--set {role}.server.allow_insecure_remote=true" for role in ("env", "policy", "learner")]):
        assert command in guide, command
