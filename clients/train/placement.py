"""Where the policy server and the learner run relative to each other (`placement` of a run's config).

| placement                 | generation and the learner step                          | threads of each role  |
|---------------------------|----------------------------------------------------------|-----------------------|
| `disaggregated` (default) | run side by side                                         | `processes.*_threads` |
| `colocated`               | take turns: the learner holds generation during its step | every core            |

Colocated: the learner holds every policy server (`PolicyService.Hold`, learner.policy_hold) from
the start of an optimizer step until its weight push has ended, so the step runs alone on the
cores, and generation then runs alone until the next step. Env steps and tool calls keep
overlapping both, since the env server is never held. vLLM's CPU worker is bound to every core
(`VLLM_CPU_OMP_THREADS_BIND`), as is the transformers backend's torch pool (`OMP_NUM_THREADS`).
It needs both roles started together on this machine: not `cluster.engine: ray`, not a shared
`policy.address`, not roles pinned to cores of their own (`processes.*_cpus`).

Why it is not the default on a small CPU machine: on 2 cores (`bench/placement.py`, SmolLM2 on
`arith_smollm2_cpu`, 600 s each) colocated made 0.89x the optimizer steps per hour and 0.72x the
generation tokens/s of disaggregated, for the same held-out gain (+26 against +25 points). Neither
torch pool runs twice as fast on two cores as on one, so taking turns with both cores loses to
each role keeping one. Colocated generated 0.69x the groups and fewer without signal (35% against
48%), its samples being less stale.
"""

from __future__ import annotations

import os
from collections.abc import Sequence


def machine_cores() -> list[int]:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def check_placement(asked: str, *, engine: str, shared_policy: bool, pinned: bool) -> None:
    """ValueError for a colocated placement the run cannot have."""
    apart = ("cluster.engine ray places the roles" if engine == "ray"
             else "policy.address shares a server this run does not start" if shared_policy
             else "processes.*_cpus pins the roles to cores of their own" if pinned else "")
    if asked == "colocated" and apart:
        raise ValueError(f"placement colocated needs the policy server and the learner started together on this"
                         f" machine, but {apart}; use placement disaggregated")


def placement_line(placement: str) -> str:
    """What a run says at its start about where its roles run."""
    if placement == "colocated":
        return (f"placement colocated: generation and the learner step take turns, each with all {len(machine_cores())}"
                " cores")
    return "placement disaggregated: generation and the learner step run side by side"


def vllm_bind(cores: Sequence[int]) -> dict[str, str]:
    """vLLM's CPU worker bound to exactly `cores`, none kept back: by itself it keeps one core of
    the machine for other work, so on 2 cores it computes on one whatever the thread setting."""
    cores = list(cores)
    contiguous = cores == list(range(cores[0], cores[-1] + 1))
    bind = f"{cores[0]}-{cores[-1]}" if contiguous and len(cores) > 1 else ",".join(map(str, cores))
    return {"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def role_env(placement: str, backend: str, threads: int, cpus: Sequence[int] = ()) -> dict[str, str] | None:
    """The environment of a policy or learner process: its thread pools' size (0: the library
    default). vLLM's CPU worker, which sizes its pool by its core binding alone, is bound to
    every core when colocated, and to `threads` of its cores (`cpus`, else the machine's) when
    disaggregated."""
    if placement == "colocated":
        cores = machine_cores()
        env = {"OMP_NUM_THREADS": str(len(cores)), "MKL_NUM_THREADS": str(len(cores))}
        return env | vllm_bind(cores) if backend == "vllm" else env
    if not threads:
        return None
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    return env | vllm_bind((list(cpus) or machine_cores())[:threads]) if backend == "vllm" else env


__all__ = ["check_placement", "machine_cores", "placement_line", "role_env", "vllm_bind"]
