"""Fixtures shared by every test folder."""

from __future__ import annotations

import os
import socket

# Aviary imports litellm, which otherwise fetches a price list over the network.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
# Test processes share two cores with the servers they start: spinning OpenMP
# workers would starve them (see clients/cli.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _bwrap_problem() -> str | None:
    from env_servers.sandbox import SandboxUnavailable, bwrap_path

    try:
        bwrap_path()
    except SandboxUnavailable as error:
        return str(error)
    return None


# Why the notebook sandbox cannot run on this host (None: it can). Where it cannot, the tests of
# the sandbox skip and the other notebook tests run it with `sandbox: none`.
BWRAP_PROBLEM = _bwrap_problem()
NOTEBOOK_SANDBOX = "bwrap" if BWRAP_PROBLEM is None else "none"

# This test process sees no network interface but loopback: the namespace scripts/test.sh runs
# pytest in (where Ray, which reaches outside when it starts, may run as a cluster).
INTERFACES = [name for _, name in socket.if_nameindex()]  # the network interfaces this test run sees
LOOPBACK_ONLY = INTERFACES == ["lo"]


# Test files that start a training run, a real engine (vLLM, Ray, Slurm), a browser, a compiler or
# a sandbox, or that go through every command of a page: marked `slow` as a whole, so that
# `scripts/test.sh --quick` (pytest -m "not slow") runs the rest while the full command runs
# everything. Each entry is one or more whole words of a file's name (words split at "_"), so that
# "ray" marks test_ray_engine.py but not a test_array_*.py, and "vllm_backend" not the vLLM source
# check (test_vllm_source.py, which only reads the wheels).
SLOW_FILES = (
    "e2e", "vllm_backend", "vllm_updates", "ray", "slurm", "smollm2", "docs_site", "docs_tutorial", "viewer",
    "wheel", "readme_commands", "no_orphans", "cpp_client", "node_client", "sandbox", "collective", "fsdp2",
    "test_train_resume", "kernel_pool", "leftovers", "bench_scripts", "step_training", "sft_phase_resume",
    "curriculum_train", "rollouts_to_learner", "protocol_major",
)
SLOW_FOLDERS = ("reliability",)

# scripts/test.sh runs on two pytest-xdist workers (`--dist loadgroup`; SCIPROTO_TEST_WORKERS=N for N, 0 serial).
# Each file's tests go to one worker together, in order, so a module's servers start once; the files that start a Ray
# cluster (Slurm's recipe starts one too) form one group, so no two Ray clusters run at once. The scheduler below
# groups them by node id: xdist's own `xdist_group` marks do nothing under pytest 9 (xdist renames a test's nodeid
# to carry its group, which pytest 9's node ids no longer allow).
ONE_AT_A_TIME = {"ray": ("test_ray_engine", "test_ray_job_submit", "test_slurm_recipe")}


def xdist_group(nodeid: str) -> str:
    """The worker group of a test: its file's shared group, else the file itself."""
    file = nodeid.split("::", 1)[0]
    stem = file.rsplit("/", 1)[-1].removesuffix(".py")
    return next((group for group, stems in ONE_AT_A_TIME.items() if stem in stems), file)


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup`: whole groups (`xdist_group`) to one worker each, in collection order."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid)

    return FileGroups(config, log)


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        name = f"_{item.path.stem}_"
        if item.path.parent.name in SLOW_FOLDERS or any(f"_{words}_" in name for words in SLOW_FILES):
            item.add_marker(pytest.mark.slow)
