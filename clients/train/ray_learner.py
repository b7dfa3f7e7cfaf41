"""Where the learner's data-parallel ranks run on Ray (`cluster.learner.ranks` > 1): a placement
group of one bundle per rank, laid out by `cluster.learner_strategy`, and for each rank the
environment of torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK) that
`learner.ranks.join` reads. Rank 0 listens for the rendezvous at its node's IP, on a port found
free there just before the ranks start; Ray gives each rank its own GPUs, which it sees from
cuda:0 (LOCAL_RANK 0)."""

from __future__ import annotations

from typing import Any

from clients.train.cluster import LearnerResources
from sciproto.config import ConfigError


def _rendezvous_point() -> tuple[str, int]:
    """On rank 0's node: its IP and a port free there now."""
    import socket

    import ray

    with socket.socket() as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    return ray.util.get_node_ip_address(), port


def learner_placement_group(ray: Any, resources: LearnerResources, strategy: str, timeout_s: float) -> Any:
    """One bundle per rank, ready, or a ConfigError saying the cluster has no room for them."""
    group = ray.util.placement_group([resources.bundle()] * resources.ranks, strategy=strategy)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(group)
        raise ConfigError(
            f"the cluster has no room for {resources.ranks} learner ranks of {resources.bundle()} "
            f"({strategy}) within {timeout_s:g} s (ray status shows what it has)")
    return group


def rank_options(ray: Any, group: Any, ranks: int) -> list[tuple[dict[str, Any], str]]:
    """For each rank, rank 0 first: the actor options that place it in its bundle of `group` with
    its rendezvous environment, and the name of its log file."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    def placed(rank: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)

    address, port = ray.get(ray.remote(_rendezvous_point).options(num_cpus=0, scheduling_strategy=placed(0)).remote())
    options = []
    for rank in range(ranks):
        env = {"RANK": str(rank), "WORLD_SIZE": str(ranks), "MASTER_ADDR": address, "MASTER_PORT": str(port),
               "LOCAL_RANK": "0"}
        options.append(({"scheduling_strategy": placed(rank), "runtime_env": {"env_vars": env}},
                         "learner.log" if rank == 0 else f"learner-rank{rank}.log"))
    return options


__all__ = ["learner_placement_group", "rank_options"]
