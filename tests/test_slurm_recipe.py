"""The Slurm recipe for real: `sbatch scripts/slurm/train-on-ray.sbatch` on a one-node Slurm cluster
started here (tests/slurm_cluster.py) starts Ray on the allocation, trains the demo with
`--cluster ray` to its step budget, and leaves no Ray process and no token file behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.slurm_cluster import free_port, slurm_cluster, slurm_missing

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "slurm" / "train-on-ray.sbatch"

pytestmark = pytest.mark.skipif(slurm_missing() is not None, reason=str(slurm_missing()))


def ray_processes(port: int) -> set[str]:
    """The Ray daemons of the cluster whose GCS listens on `port`, in this test's network namespace.
    Other tests start Ray in the same namespace at the same time (scripts/test.sh gives the whole
    run one, and its workers run tests side by side), so a daemon counts only by its own arguments:
    the GCS by `--gcs_server_port=PORT`, a raylet by `--gcs-address=HOST:PORT`."""
    found = subprocess.run(["pgrep", "-f", "ray/core/src/ray/gcs/gcs_server|raylet/raylet"],
                           capture_output=True, text=True, check=False).stdout.split()
    ours = os.readlink("/proc/self/ns/net")

    def of_this_cluster(pid: str) -> bool:
        try:
            if os.readlink(f"/proc/{pid}/ns/net") != ours:
                return False
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            return False
        return any(arg == f"--gcs_server_port={port}" or
                   (arg.startswith("--gcs-address=") and arg.endswith(f":{port}")) for arg in argv)

    return {pid for pid in found if of_this_cluster(pid)}


def wait_until_gone(port: int, timeout_s: float) -> set[str]:
    """The cluster's daemons still running after at most `timeout_s` (Slurm ends a job's steps
    with SIGTERM, then SIGKILL after its KillWait)."""
    deadline = time.monotonic() + timeout_s
    while (left := ray_processes(port)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@pytest.mark.timeout(900)
def test_the_sbatch_recipe_starts_ray_and_trains_the_demo(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    log = tmp_path / "job.log"
    with slurm_cluster(tmp_path / "slurm") as cluster:
        # Loopback only on this machine: Ray takes 127.0.0.1 as the node's address.
        port = free_port()
        cluster.env |= {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_NODE_IP": "127.0.0.1",
                        "SCIPROTO_VENV": sys.prefix, "RAY_PORT": str(port)}
        done = cluster.sbatch_wait(
            ["--nodes=1", f"--output={log}", f"--chdir={ROOT}", str(SCRIPT),
             "--config", "demo", "--fresh", "--set", "budget.max_steps=2", "--set", f"run.dir={runs}",
             "--set", "progress=false",
             # The allocation is this 2-core machine: half a CPU per server fits all three on it.
             *[arg for role in ("env", "policy", "learner") for arg in ("--set", f"cluster.{role}.cpus=0.5")]],
            timeout_s=900, cwd=ROOT)
        # Slurm itself stops the job's Ray, before the test's cluster is torn down (which kills
        # whatever its jobs left).
        left = wait_until_gone(port, timeout_s=60)
    text = log.read_text() if log.exists() else ""
    assert done.returncode == 0, f"sbatch: {done.stdout}{done.stderr}\njob log (end):\n{text[-4000:]}"
    assert "Ray is up on 1 node(s)" in text
    summary = json.loads(next(runs.glob("demo*/summary.json")).read_text())
    assert summary["steps"][-1]["step"] == 2
    assert not list(ROOT.glob(".ray-token-*")), "the job's Ray token file was left behind"
    assert not left, f"Ray processes of the job outlived it: {sorted(left)}"
