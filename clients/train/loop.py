"""The training loop of `sciproto train`, top to bottom: rollout groups in, optimizer steps out.

    tasks -> collect (env Reset/Step/Verify, policy Generate) -> groups -> TrainStep -> steps

1. Tasks: the split (or the curriculum's tasks of it), cycled; each pass is an epoch, and a
   resumed run starts after the groups its learner trained. A task is admitted only while fewer
   than `max_groups_ahead` groups are started and not yet consumed by the learner (`Flow`): with
   max_staleness 0 and one batch ahead this is synchronous on-policy GRPO; more lets generation
   run while the learner trains (async GRPO). (clients.train.producers.TaskStream)
2. Groups: one producer per rollout mode (clients.train.producers): `samples` episodes per task
   (grouping trajectory), a task's step groups on forks of its episode (grouping step), runs of an
   external agent (rollout.agent), and before them the sft phases' demonstrations. A finished
   group is written to rollouts.jsonl and sent to the learner (`GroupSink`).
3. The learner's events: a receipt settles a group (accepted, refused, no room: sent again), a
   step result consumes groups and may spend the budget, a step failure gives groups back
   (clients.train.events).
4. It ends when the budget is spent, `stop` is set (Ctrl-C, the time budget) or a part fails.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from clients.agent import env_pool, policy_pool
from clients.train.calibration import calibrate
from clients.train.config import TrainConfig
from clients.train.display import Progress, RunStatus
from clients.train.engine import Role, ServerGone, Servers
from clients.train.events import LearnerEvents
from clients.train.flow import Flow, GroupLedger
from clients.train.producers import GroupSink, Production, open_tasks, produce
from clients.train.records import StepRecord, TrainOutcome
from clients.train.stream import LearnerStream
from clients.train.task_stats import TaskStatsFile
from sciproto.errors import from_rpc_error
from sciproto.rundir import ROLLOUTS_FILE

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 2.0  # how often the engine's servers are asked whether a role is gone for good


def _target_of(servers: Servers, role: Role, index: int) -> str:
    """Where replica `index` of `role` listens now (a ReplicaPool's `resolve`)."""
    return servers.targets(role)[index]


async def run_rollouts_into_learner(
    config: TrainConfig,
    env_target: str | Sequence[str],
    policy_target: str | Sequence[str],
    learner_target: str,
    run_dir: Path,
    stop: asyncio.Event,
    on_step: Callable[[StepRecord, TrainOutcome], None] = lambda *_: None,
    display: Progress | None = None,
    servers: Servers | None = None,
) -> TrainOutcome:
    """Stream rollout groups into the learner until the budget is spent or `stop` is set.

    Every group stays in a ledger (clients.train.flow) until the learner settles it; a broken
    TrainStep stream is opened again (for up to rollout.learner_reconnect_s) and every unsettled
    group is sent again on it (clients.train.stream). With the engine's `servers`, a replica that
    comes back at a new address (a restarted actor) is found there, and a role gone for good stops
    the run."""
    rollout = config.rollout
    flow = Flow(config.max_groups_ahead)
    ledger = GroupLedger()
    status = RunStatus(batch_groups=config.learner.batch_groups)
    outcome = TrainOutcome(run_dir=str(run_dir))
    learner = LearnerStream(learner_target, ledger, status, rollout.learner_reconnect_s)
    run_dir.mkdir(parents=True, exist_ok=True)

    env_targets = [env_target] if isinstance(env_target, str) else list(env_target)
    policy_targets = [policy_target] if isinstance(policy_target, str) else list(policy_target)
    moves: dict[str, dict[str, Any]] = {} if servers is None else {
        role: {"resolve": functools.partial(_target_of, servers, role),
               "wait_for_healthy_s": config.cluster.restart_wait_s} for role in ("env", "policy")}
    async with (env_pool(env_targets, **moves.get("env", {})) as env,
                policy_pool(policy_targets, **moves.get("policy", {})) as policy):
        # 0. The policy servers' rate alone, before anything else runs (not in the run's seconds).
        calibration = await calibrate(
            policy, groups=config.display.calibration_groups, samples=rollout.samples,
            max_tokens=min(config.display.calibration_max_tokens, rollout.sampling.max_tokens),
            temperature=rollout.sampling.temperature, timeout_s=rollout.deadlines.generate_s)
        outcome.calibration = calibration.summary() if calibration is not None else {}
        started = time.monotonic()
        # 1. Tasks.
        tasks = await open_tasks(rollout, env, run_dir, flow, status)
        stats_file = TaskStatsFile(run_dir, config.learner.checkpoint_every)

        def stepped(record: StepRecord, outcome: TrainOutcome) -> None:
            stats_file.save(tasks.stats, record.step)
            on_step(record, outcome)

        events = LearnerEvents(config.budget, flow, ledger, status, outcome, learner, stop, started, stepped)
        with (
            (run_dir / ROLLOUTS_FILE).open("a", encoding="utf-8") as rollouts_file,
            (run_dir / "rollouts.failures.jsonl").open("w", encoding="utf-8") as failures_file,
        ):
            # 2. Groups.
            sink = GroupSink(rollout, learner, flow, status, outcome, rollouts_file, failures_file, tasks.stats)
            production = Production(
                config, env, policy, lambda: servers.targets("policy") if servers is not None else policy_targets,
                tasks, sink, ledger, run_dir, started)
            # 3. The learner's events; 4. run until the budget is spent, `stop` is set or a part fails.
            workers = [
                asyncio.create_task(produce(production, events.stop_with), name="rollouts"),
                asyncio.create_task(learner.run(events.handle), name="learner stream"),
            ]
            if display is not None:
                workers.append(asyncio.create_task(_tick(display, status, flow), name="display"))
            if config.budget.max_seconds is not None:
                workers.append(asyncio.create_task(_deadline(config.budget.max_seconds, events), name="deadline"))
            if servers is not None:
                workers.append(asyncio.create_task(_watch(servers), name="servers"))
            try:
                await _until_done(workers, stop)
            finally:
                outcome.stopped_by = outcome.stopped_by or "interrupted"
                await _cancel(workers)
                events.settle()
                outcome.task_stats = tasks.stats.summary()
                if status.step:  # the learner's final checkpoint is of this step (or the one in flight)
                    stats_file.save(tasks.stats, status.step)
    return outcome


async def _until_done(workers: list[asyncio.Task], stop: asyncio.Event) -> None:
    """Wait until `stop` is set or a worker ends; raise the error of one that failed."""
    stopper = asyncio.create_task(stop.wait())
    try:
        done, _ = await asyncio.wait([*workers, stopper], return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task is not stopper and task.exception() is not None:
                error = task.exception()
                raise from_rpc_error(error) if isinstance(error, grpc.RpcError) else error  # type: ignore[misc]
    finally:
        workers.append(stopper)


async def _cancel(tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _tick(display: Progress, status: RunStatus, flow: Flow) -> None:
    while True:
        status.groups_generating = flow.in_flight
        display.tick(status)
        await asyncio.sleep(1.0)


async def _watch(servers: Servers) -> None:
    """A role gone for good ends the run with the engine's one line."""
    while True:
        await asyncio.sleep(WATCH_INTERVAL_S)
        if (line := await asyncio.to_thread(servers.failure)) is not None:
            raise ServerGone(line)


async def _deadline(seconds: float, events: LearnerEvents) -> None:
    await asyncio.sleep(seconds)
    events.stop_with("max_seconds")


__all__ = ["run_rollouts_into_learner"]
