"""The child processes of `sciproto train`: env, policy and learner servers, started and stopped.

Each server reads its own section of the run's resolved `config.yaml`; its output goes to
`<run_dir>/<name>.log`. `cpus` pins a child (and every thread it starts) to those CPU cores with
`taskset`, so generation and training can be given cores of their own.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Self

import yaml

from clients.train.placement import role_env
from sciproto.processes import ServerProcess, sciproto_command, start_command

if TYPE_CHECKING:
    from learner.server_config import LearnerServerConfig

log = logging.getLogger(__name__)


class ProcessOptions(Protocol):
    """How the children start (`processes` of a run's config: `clients.train.ProcessSettings`)."""

    start_timeout_s: float
    stop_timeout_s: float
    policy_threads: int
    learner_threads: int
    env_cpus: list[int]
    policy_cpus: list[int]
    learner_cpus: list[int]


class StepBudget(Protocol):
    max_steps: int | None


class SharedPolicy(Protocol):
    address: str | None  # a running policy server the run shares instead of starting one
    backend: str


class RunConfig(Protocol):
    """What starting the servers reads of a run's config (`clients.train.TrainConfig`, a pydantic
    model). A protocol, so that this module does not import the one that calls it."""

    policy: SharedPolicy
    placement: str  # resolved: "colocated" or "disaggregated" (clients.train.placement)
    learner: LearnerServerConfig
    budget: StepBudget
    processes: ProcessOptions

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> Self: ...

    def model_dump(self, *, mode: str = "python") -> dict[str, Any]: ...


def write_component_config(config: RunConfig, run_dir: Path, policy_target: str) -> Path:
    """The resolved config every child reads its own section of."""
    learner = config.learner.model_copy(
        update={
            "policy_targets": [policy_target],
            "run_dir": run_dir,
            "max_steps": config.budget.max_steps,
            # Half the stop's wait for the step in flight, half for the final checkpoint.
            "stop_step_wait_s": config.processes.stop_timeout_s / 2,
        }
    )
    resolved = config.model_copy(update={"learner": learner})
    path = run_dir / "config.yaml"
    path.write_text(yaml.safe_dump(resolved.model_dump(mode="json"), sort_keys=False))
    return path


def pinned(command: list[str], cpus: Sequence[int]) -> list[str]:
    """`command` run on the CPU cores `cpus` only (all cores when empty)."""
    if not cpus:
        return command
    taskset = shutil.which("taskset")
    if taskset is None:
        raise RuntimeError("pinning servers to cores needs `taskset` (util-linux); install it or "
                           "leave processes.*_cpus empty")
    return [taskset, "-c", ",".join(str(c) for c in cpus), *command]


def serve_command(component: str, config_path: Path, cpus: Sequence[int] = (), port: int = 0) -> list[str]:
    """The command line of `sciproto serve COMPONENT` on this run's config."""
    return pinned(
        sciproto_command("serve", component, "--config", str(config_path), "--port", str(port)), cpus
    )


def start_servers(config: RunConfig, run_dir: Path) -> dict[str, ServerProcess]:
    """Env and policy servers (side by side), then the learner once the policy's port is known.
    With `policy.address` no policy server starts: the learner pushes to that one."""
    processes: dict[str, ServerProcess] = {}
    settings = config.processes
    timeout_s = settings.start_timeout_s
    base_path = run_dir / "config.yaml"
    base_path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            futures = {
                "env": pool.submit(
                    start_command,
                    serve_command("env", base_path, settings.env_cpus),
                    timeout_s=timeout_s,
                    log_file=run_dir / "env.log",
                ),
            }
            if config.policy.address is None:
                futures["policy"] = pool.submit(
                    start_command,
                    serve_command("policy", base_path, settings.policy_cpus),
                    timeout_s=timeout_s,
                    log_file=run_dir / "policy.log",
                    env=role_env(config.placement, config.policy.backend, settings.policy_threads, settings.policy_cpus),
                )
            failures = []
            for name, future in futures.items():
                try:
                    processes[name] = future.result()
                except Exception as error:  # noqa: BLE001 - every failure is reported together below
                    failures.append(f"{name}: {getattr(error, 'headline', error)}")
            if failures:
                raise RuntimeError("could not start the servers:\n" + "\n".join(failures))
        policy_target = config.policy.address or processes["policy"].target
        path = write_component_config(config, run_dir, policy_target)
        processes["learner"] = start_command(
            serve_command("learner", path, settings.learner_cpus),
            timeout_s=timeout_s,
            log_file=run_dir / "learner.log",
            env=role_env(config.placement, "learner", settings.learner_threads),
        )
    except BaseException:
        stop_servers(processes, settings.stop_timeout_s)
        raise
    return processes


def stop_servers(processes: dict[str, ServerProcess], timeout_s: float) -> None:
    """The learner first (it saves a checkpoint on SIGTERM), then the servers it talks to."""
    for name in ("learner", "policy", "env"):
        if name in processes:
            code = processes[name].stop(grace_s=timeout_s)
            if code not in (0, None):
                log.warning(
                    "%s server exited with %s; see its log in the run directory", name, code
                )


__all__ = ["serve_command", "start_servers", "stop_servers", "write_component_config"]
