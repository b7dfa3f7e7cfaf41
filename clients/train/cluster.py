"""The `cluster` section of a run's config: which engine starts the servers (`local`: child
processes, the default; `ray`: Ray actors, `clients.train.ray_engine`), and on Ray how many
replicas of each role run and what each asks the cluster for."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class RoleResources(BaseModel):
    """What each replica of one role asks the cluster for."""

    model_config = ConfigDict(extra="forbid")

    replicas: int = Field(1, ge=1, description="Servers of this role")
    cpus: float = Field(1.0, ge=0, description="CPUs each replica reserves")
    gpus: float = Field(0.0, ge=0, description="GPUs each replica reserves (the policy's: one bundle per replica)")
    resources: dict[str, float] = Field(
        default_factory=dict, description="Custom resources each replica reserves (e.g. {trainer: 1})")
    max_restarts: int = Field(3, ge=-1, description="Times Ray restarts a lost replica (-1: always)")

    def bundle(self) -> dict[str, float]:
        """The placement-group bundle of one replica."""
        wanted = {"CPU": self.cpus, "GPU": self.gpus, **self.resources}
        return {name: amount for name, amount in wanted.items() if amount > 0}


class LearnerResources(RoleResources):
    """What each rank of the learner asks the cluster for (one placement-group bundle per rank)."""

    replicas: int = Field(1, ge=1, description="Always 1: the learner scales by `ranks`")
    ranks: int = Field(
        1, ge=1, description=(
            "Data-parallel ranks of the learner (FSDP2), each an actor with `cpus`/`gpus`/`resources` of its "
            "own: rank 0 serves LearnerService, the others follow it"))
    max_restarts: int = Field(
        0, ge=-1, description="Times Ray restarts a lost learner (0: a lost learner stops the run, a rerun resumes)")

    @model_validator(mode="after")
    def _ranks_are_not_replicas(self) -> LearnerResources:
        if self.replicas != 1:
            raise ValueError(f"the learner has one replica (replicas {self.replicas}); for data parallelism "
                             "set cluster.learner.ranks")
        if self.ranks > 1 and self.max_restarts != 0:
            raise ValueError(f"a learner of {self.ranks} ranks cannot be restarted rank by rank: set "
                             "cluster.learner.max_restarts 0 (a lost rank stops the run, a rerun resumes)")
        return self


class ClusterSettings(BaseModel):
    """`cluster` of a run's config: which engine starts the servers, and on Ray where each role runs."""

    model_config = ConfigDict(extra="forbid")

    engine: Literal["local", "ray"] = Field(
        "local", description="local: child processes of `sciproto train`; ray: Ray actors (`--cluster ray`)")
    address: str | None = Field(
        None, description="Ray cluster to join (`--ray-address`; else RAY_ADDRESS; else a local Ray for the run)")
    object_store_mb: int = Field(256, ge=64, description="Object store of a local Ray started for the run")
    num_cpus: int | None = Field(
        None, ge=1, description=("Logical CPUs of a local Ray started for the run (default: the machine's CPUs, or "
                                 "what the servers ask for in all if that is more)"))
    start_timeout_s: float = Field(300.0, gt=0, description="Longest wait for a server to report its address")
    stop_timeout_s: float = Field(120.0, gt=0, description="Longest wait for a server to stop")
    restart_wait_s: float = Field(
        180.0, gt=0, description="Longest the rollout client waits for a restarting replica while none of its role is up")
    env: RoleResources = Field(default_factory=RoleResources)
    policy: RoleResources = Field(default_factory=RoleResources)
    policy_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="How the policy placement group lays its bundles over nodes")
    learner: LearnerResources = Field(default_factory=LearnerResources)
    learner_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="How the learner's placement group (cluster.learner.ranks > 1) lays its ranks over nodes")


__all__ = ["ClusterSettings", "LearnerResources", "RoleResources"]
