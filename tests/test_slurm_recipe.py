"""The Slurm recipe for real: `sbatch scripts/slurm/train-on-ray.sbatch` on a one-node Slurm cluster
started here (tests/slurm_cluster.py) starts Ray on the allocation, trains the demo with
`--cluster ray` to its step budget, and leaves no Ray process and no token file behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.slurm_cluster import free_port, slurm_cluster, slurm_missing

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "slurm" / "train-on-ray.sbatch"

pytestmark = pytest.mark.skipif(slurm_missing() is not None, reason=str(slurm_missing()))


def ray_processes() -> set[str]:
    """Ray's daemons in this test's network namespace (scripts/test.sh gives the run one of its own:
    a Ray of another run on the machine is not this job's)."""
    found = subprocess.run(["pgrep", "-f", "ray/core/src/ray/gcs/gcs_server|raylet/raylet"],
                           capture_output=True, text=True, check=False).stdout.split()
    ours = os.readlink("/proc/self/ns/net")

    def here(pid: str) -> bool:
        try:
            return os.readlink(f"/proc/{pid}/ns/net") == ours
        except OSError:
            return False

    return {pid for pid in found if here(pid)}


@pytest.mark.timeout(900)
def test_the_sbatch_recipe_starts_ray_and_trains_the_demo(tmp_path: Path) -> None:
    before = ray_processes()
    runs = tmp_path / "runs"
    log = tmp_path / "job.log"
    with slurm_cluster(tmp_path / "slurm") as cluster:
        # Loopback only on this machine: Ray takes 127.0.0.1 as the node's address.
        cluster.env |= {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_NODE_IP": "127.0.0.1",
                        "SCIPROTO_VENV": sys.prefix, "RAY_PORT": str(free_port())}
        done = cluster.sbatch_wait(
            ["--nodes=1", f"--output={log}", f"--chdir={ROOT}", str(SCRIPT),
             "--config", "demo", "--fresh", "--set", "budget.max_steps=2", "--set", f"run.dir={runs}",
             "--set", "progress=false",
             # The allocation is this 2-core machine: half a CPU per server fits all three on it.
             *[arg for role in ("env", "policy", "learner") for arg in ("--set", f"cluster.{role}.cpus=0.5")]],
            timeout_s=900, cwd=ROOT)
    text = log.read_text() if log.exists() else ""
    assert done.returncode == 0, f"sbatch: {done.stdout}{done.stderr}\njob log (end):\n{text[-4000:]}"
    assert "Ray is up on 1 node(s)" in text
    summary = json.loads(next(runs.glob("demo*/summary.json")).read_text())
    assert summary["steps"][-1]["step"] == 2
    assert not list(ROOT.glob(".ray-token-*")), "the job's Ray token file was left behind"
    assert ray_processes() <= before, "a Ray process of the job outlived it"
