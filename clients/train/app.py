"""`sciproto train` as a command: choose the run directory, start the servers on an engine, run the
loop under a progress display with Ctrl-C as a clean stop, then stop the servers and report."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from pathlib import Path

from rich.console import Console

from clients.agent_process import AgentProgram, AgentStartError, check_preload
from clients.train.config import AgentCommand, TrainConfig, check_envs, load_train_config
from clients.train.display import Progress
from clients.train.engine import Engine, Servers, engine_for
from clients.train.loop import run_rollouts_into_learner
from clients.train.placement import placement_line
from clients.train.records import TrainOutcome
from clients.train.resume import choose_run_dir, trained_steps
from clients.train.summary import finish_outputs, print_summary, settle_with_learner
from sciproto.config import ConfigError

log = logging.getLogger(__name__)

# Ctrl-C, or a supervisor's polite stop: both end the run cleanly with every output written.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def train(config: TrainConfig, engine: Engine | None = None) -> TrainOutcome:
    """Run a whole training job (see the package docstring) on `engine` (default: the one
    `cluster.engine` names, child processes here unless it says ray) and return what it did."""
    run_dir = choose_run_dir(config.run.dir, config.run.name, config.run.resume)
    done, limit = trained_steps(run_dir), config.budget.max_steps
    if limit is not None and done >= limit:
        raise ConfigError(f"{run_dir} has trained {done} steps already (budget.max_steps={limit}): raise"
                          " budget.max_steps to continue it, or pass --fresh to start over")
    run_dir.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True)
    console.print(f"[bold]sciproto train[/bold]: run directory {run_dir}")
    console.print(placement_line(config.placement))
    servers = (engine or engine_for(config)).start(config, run_dir)
    outcome = TrainOutcome(run_dir=str(run_dir), stopped_by="aborted")
    progress = Progress(config.budget.max_steps, config.progress, config.display.stall_after_s,
                        config.budget.max_seconds)
    try:
        outcome = asyncio.run(_train_async(config, servers, run_dir, progress))
    finally:
        outcome.placement = config.placement
        progress.close()
        # The learner first: on SIGTERM it finishes the step in flight (within stop_timeout_s),
        # logs it and writes its final checkpoint, which the summary then agrees with.
        servers.stop()
        settle_with_learner(outcome, run_dir, resumed_at=done)
        finish_outputs(outcome, run_dir)
    return outcome


async def _train_async(
    config: TrainConfig, servers: Servers, run_dir: Path, progress: Progress
) -> TrainOutcome:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def interrupted() -> None:
        log.warning("interrupted: stopping after a final checkpoint (Ctrl-C again to abort)")
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)  # a second signal aborts
        stop.set()

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, interrupted)

    try:
        outcome = await run_rollouts_into_learner(
            config,
            servers.targets("env"),
            servers.targets("policy"),
            servers.targets("learner")[0],
            run_dir,
            stop,
            display=progress,
            servers=servers,
        )
    finally:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            for sig in STOP_SIGNALS:
                loop.remove_signal_handler(sig)
    # No checkpoint asked for here: the learner writes its final one when it is stopped, after
    # the step in flight, and takes no further batch (asking now would let it start one more).
    return outcome


def check_agent_preload(agent: AgentCommand | None) -> None:
    """Refuse, before any server starts, a preload the agent's interpreter cannot import (it costs
    a start of the fork server: the preload's import time)."""
    if agent is None or not agent.preload:
        return
    try:
        asyncio.run(check_preload(AgentProgram(agent.command, agent.timeout_s, tuple(agent.preload))))
    except AgentStartError as error:
        raise ConfigError(f"rollout.agent: {error}") from None


def main(config: str | None, overrides: list[str]) -> TrainOutcome:
    """`sciproto train`: see the module docstring."""
    try:
        settings = load_train_config(config or "demo", overrides)
        check_envs(settings.env.envs, settings.env.imports)
        check_agent_preload(settings.rollout.agent)
    except ConfigError as error:
        raise SystemExit(f"sciproto train: {error}") from None
    outcome = train(settings)
    print_summary(outcome)
    return outcome


__all__ = ["STOP_SIGNALS", "main", "train"]
