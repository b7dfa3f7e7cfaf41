"""The suite's two-worker mode (SCIPROTO_TEST_WORKERS, tests/conftest.py): each file's tests run on
one worker, in order, so the servers a module starts once serve all its tests."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = ("tests/clients/test_placement.py", "tests/clients/test_train_config.py")


def test_each_files_tests_run_on_one_worker() -> None:
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
                             "-v", *FILES], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    workers: dict[str, set[str]] = defaultdict(set)
    for worker, path in re.findall(r"\[(gw\d+)\] \[ *\d+%\] PASSED (tests/[^:]+)::", result.stdout):
        workers[path].add(worker)
    assert set(workers) == set(FILES), result.stdout[-3000:]
    assert all(len(ran_on) == 1 for ran_on in workers.values()), f"a file's tests were split over workers: {workers}"


def test_the_files_that_start_a_ray_cluster_share_one_group() -> None:
    from tests.conftest import xdist_group

    groups = {xdist_group(nodeid) for nodeid in ("tests/clients/test_ray_engine.py::test_a",
                                                  "tests/test_ray_job_submit.py::test_b[x]",
                                                  "tests/test_slurm_recipe.py::test_c")}
    assert groups == {"ray"}
    assert xdist_group("tests/clients/test_array_stats.py::test_d") == "tests/clients/test_array_stats.py"
