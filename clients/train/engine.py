"""Where a run's servers run: the seam between `sciproto train` and what starts its processes.

An `Engine` starts the env, policy and learner servers of a run and gives back `Servers`: the
addresses of each role's replicas, whether a role is gone for good, and a bounded stop (the
learner first: on SIGTERM it finishes the step in flight and writes its final checkpoint). The
training loop, its ledger, display and resume are the same code whatever the engine.

`LocalEngine` (the default) starts each server as a child process of this one
(`clients.train.processes`); `RayEngine` (`cluster.engine: ray`, `sciproto train --cluster ray`)
starts each as a Ray actor (`clients.train.ray_engine`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

from clients.train.processes import start_servers, stop_servers

if TYPE_CHECKING:
    from clients.train.config import TrainConfig
    from sciproto.processes import ServerProcess

Role = Literal["env", "policy", "learner"]
ROLES: tuple[Role, ...] = ("env", "policy", "learner")


class ServerGone(RuntimeError):
    """A server of the run is gone for good: the run stops, and its message (the engine's one
    line, `Servers.failure`) is what `sciproto train` prints."""


class Servers(Protocol):
    """The servers of one run, however they were started."""

    def targets(self, role: Role) -> list[str]:
        """The current host:port of each replica of `role` (may change after a restart)."""
        ...

    def failure(self) -> str | None:
        """One line naming a role that is gone for good (the run then stops); None while all run."""
        ...

    def stop(self) -> None:
        """The learner first (it checkpoints), then the policy and env servers; bounded."""
        ...


class Engine(Protocol):
    def start(self, config: TrainConfig, run_dir: Path) -> Servers: ...


class LocalServers:
    """The child processes of one run, one per role; the policy server may be a shared one the run
    did not start (`policy.address`), which it neither watches nor stops."""

    def __init__(self, processes: dict[str, ServerProcess], stop_timeout_s: float,
                 shared_policy: str | None = None) -> None:
        self.processes = processes
        self.stop_timeout_s = stop_timeout_s
        self.shared_policy = shared_policy

    def targets(self, role: Role) -> list[str]:
        if role == "policy" and self.shared_policy is not None:
            return [self.shared_policy]
        return [self.processes[role].target]

    def failure(self) -> str | None:
        for role in ROLES:
            process = self.processes.get(role)
            if process is not None and not process.alive():
                return f"the {role} server exited; see {role}.log in the run directory"
        return None

    def stop(self) -> None:
        stop_servers(self.processes, self.stop_timeout_s)


class LocalEngine:
    """Every server a child process of this one, on this machine."""

    def start(self, config: TrainConfig, run_dir: Path) -> LocalServers:
        return LocalServers(start_servers(config, run_dir), config.processes.stop_timeout_s, config.policy.address)


def engine_for(config: TrainConfig) -> Engine:
    """The engine `config.cluster.engine` names."""
    if config.cluster.engine == "ray":
        from clients.train.ray_engine import RayEngine

        return RayEngine(config.cluster)
    return LocalEngine()


__all__ = ["ROLES", "Engine", "LocalEngine", "LocalServers", "Role", "ServerGone", "Servers", "engine_for"]
