"""The training loop of `sciproto train`, top to bottom: rollout groups in, optimizer steps out.

    tasks -> collect (env Reset/Step/Verify, policy Generate) -> groups -> TrainStep -> steps

1. Tasks: the split (or the curriculum's tasks of it), cycled; each pass is an epoch, and a
   resumed run starts after the groups its learner trained. A task is admitted only while fewer
   than `max_groups_ahead` groups are started and not yet consumed by the learner (`Flow`): with
   max_staleness 0 and one batch ahead this is synchronous on-policy GRPO; more lets generation
   run while the learner trains (async GRPO).
2. Groups: `collect` plays `samples` episodes per task (grouping trajectory), or
   `collect_step_tasks` plays a task's step groups on forks of its episode (grouping step). A
   finished group is written to rollouts.jsonl and sent to the learner.
3. The learner's events: a receipt settles a group (accepted, refused, no room: sent again), a
   step result consumes groups and may spend the budget, a step failure gives groups back.
4. It ends when the budget is spent, `stop` is set (Ctrl-C, the time budget) or a part fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import IO, Any

import grpc

from clients.agent import AgentSettings, env_pool, policy_pool
from clients.agent_process import AgentProgram, AgentStartError, launcher
from clients.collect import collect, collect_step_tasks, fork_mode, split_size, stream_runs
from clients.curriculum import read_curriculum
from clients.external_agent import run_agent_group
from clients.train.config import TrainConfig
from clients.train.display import Progress, RunStatus
from clients.train.engine import Role, ServerGone, Servers
from clients.train.flow import Flow, GroupLedger
from clients.train.phases import sft_groups
from clients.train.records import (
    StepGroupTally,
    StepRecord,
    TrainOutcome,
    budget_spent,
    group_to_pb,
    with_epoch,
)
from clients.train.resume import resume_point, trained_group_ids
from clients.train.stream import LearnerStream
from gateway.local import LocalGateway
from sciproto.client.rollouts import RolloutGroup, RolloutStatus, TaskKey
from sciproto.config import ConfigError
from sciproto.errors import from_rpc_error
from sciproto.pb import env_pb2, learner_pb2

log = logging.getLogger(__name__)

# Groups whose every agent run failed, before any run worked, that stop the run as misconfigured.
AGENT_FAILED_GROUPS_BEFORE_STOP = 2

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
    env_name, split = rollout.split()
    flow = Flow(config.max_groups_ahead)
    ledger = GroupLedger()
    status = RunStatus(batch_groups=config.learner.batch_groups)
    outcome = TrainOutcome(run_dir=str(run_dir))
    learner = LearnerStream(learner_target, ledger, status, rollout.learner_reconnect_s)
    started = time.monotonic()
    run_dir.mkdir(parents=True, exist_ok=True)

    env_targets = [env_target] if isinstance(env_target, str) else list(env_target)
    policy_targets = [policy_target] if isinstance(policy_target, str) else list(policy_target)
    moves: dict[str, dict[str, Any]] = {} if servers is None else {
        role: {"resolve": functools.partial(_target_of, servers, role),
               "wait_for_healthy_s": config.cluster.restart_wait_s} for role in ("env", "policy")}
    async with (env_pool(env_targets, **moves.get("env", {})) as env,
                policy_pool(policy_targets, **moves.get("policy", {})) as policy):
        # 1. Tasks.
        size = await split_size(env, env_name, split, rollout.deadlines.describe_s)
        if rollout.grouping == "step":
            mode = await fork_mode(env, env_name, rollout.deadlines.describe_s)
            if mode == env_pb2.FORK_MODE_UNSUPPORTED:
                raise ConfigError(f"rollout.grouping step forks episodes, and environment {env_name!r} cannot fork"
                                  " (Describe: fork unsupported); use grouping trajectory")
        chosen = read_curriculum(rollout.curriculum).indices if rollout.curriculum else None
        # A resumed run continues after the groups its learner trained, never re-sending one.
        point = resume_point(trained_group_ids(run_dir), env_name, split, size)
        epochs: dict[TaskKey, int] = point.epochs
        if point.trained:
            log.info("resuming after %d trained groups of %s:%s", point.trained, env_name, split)

        async def tasks() -> AsyncIterator[TaskKey]:
            for number in itertools.count(point.start):
                await flow.admit()
                status.groups_generating = flow.in_flight
                # Epochs over a bounded split (or the curriculum's tasks of it); an unbounded split
                # (any index is a task) never repeats.
                if chosen is not None:
                    yield TaskKey(env_name, split, chosen[number % len(chosen)])
                else:
                    yield TaskKey(env_name, split, number if size is None else number % size)

        def next_epoch(task: TaskKey) -> int:
            epoch = epochs.get(task, 0)
            epochs[task] = epoch + 1
            return epoch

        # 2. Groups.
        def send(group: RolloutGroup, epoch: int, rollouts_file: IO[str], failures_file: IO[str]) -> None:
            """Write a finished group's records and send it to the learner (in the ledger)."""
            group_id, records = with_epoch(group, epoch)
            for record in records:
                sink = failures_file if record.status is RolloutStatus.INFRA_ERROR else rollouts_file
                sink.write(record.to_json_line(rollout.rollouts_file))
            outcome.groups_generated += 1
            outcome.completion_tokens += sum(r.tokens.completion for r in records)
            status.groups_finished = outcome.groups_generated
            status.rollouts_finished += len(records)
            status.completion_tokens = outcome.completion_tokens
            learner.send(learner_pb2.TrainStepRequest(group=group_to_pb(group_id, records)))

        async def produce_demonstrations() -> None:
            """The sft phases: every demonstration group not trained before, then a wait until the
            learner has settled them all (clients.train.phases)."""
            pending = sft_groups(config.phases, config.learner.batch_groups, trained_group_ids(run_dir))
            status.phase = "sft"
            for group in pending:
                await flow.admit()
                learner.send(learner_pb2.TrainStepRequest(group=group_to_pb(
                    group.group_id, [group.record], learner_pb2.TRAIN_OBJECTIVE_SFT)))
                flow.group_finished()
                outcome.demonstrations_sent += 1
            async with flow.changed:
                await flow.changed.wait_for(lambda: not any(g.group_id in ledger.unsettled for g in pending))
            status.phase = "grpo"
            status.generating_since = time.monotonic()
            outcome.sft_seconds = status.generating_since - started

        async def produce(rollouts_file: IO[str], failures_file: IO[str]) -> None:
            if config.phases:
                await produce_demonstrations()
                if not config.runs_grpo:
                    outcome.stopped_by = outcome.stopped_by or "phases"
                    stop.set()
                    return
            if rollout.grouping == "step":
                await produce_step_groups(rollouts_file, failures_file)
                return
            if rollout.agent is not None:
                await produce_agent_groups(rollouts_file, failures_file)
                return
            async for group in collect(
                tasks(),
                env=env,
                policy=policy,
                samples=rollout.samples,
                concurrency=rollout.concurrency,
                sampling=rollout.sampling,
                max_steps=rollout.max_steps,
                max_tokens=rollout.max_tokens,
                retries=rollout.retries,
                deadlines=rollout.deadlines,
                options=rollout.options,
            ):
                deliver(group, rollouts_file, failures_file)

        def deliver(group: RolloutGroup, rollouts_file: IO[str], failures_file: IO[str]) -> None:
            """A finished trajectory group: to the learner and the rollout files."""
            flow.group_finished()
            send(group, next_epoch(group.task), rollouts_file, failures_file)
            rollouts_file.flush()
            failures_file.flush()
            status.groups_generating = flow.in_flight

        async def produce_agent_groups(rollouts_file: IO[str], failures_file: IO[str]) -> None:
            """rollout.agent: each task admitted is `samples` runs of the external program, each in
            a session of a gateway on the run's policy servers, graded by the env's Verify
            (clients.external_agent); the group goes to the learner like any other."""
            assert rollout.agent is not None
            program = AgentProgram(rollout.agent.command, rollout.agent.timeout_s, tuple(rollout.agent.preload))

            @contextlib.asynccontextmanager
            async def lease() -> AsyncIterator[Any]:
                async with env.lease() as replica:
                    yield replica.client

            try:
                async with LocalGateway(policy_pool_targets()) as gateway, launcher(program) as launch:
                    groups = stream_runs(tasks(), max(1, rollout.concurrency // rollout.samples),
                                         lambda task: run_agent_group(gateway, lease, launch, task, rollout.samples,
                                                                      rollout.options))
                    failed_groups, any_ran = 0, False  # groups in a row whose every run failed
                    async with contextlib.aclosing(groups):
                        async for group in groups:
                            deliver(group, rollouts_file, failures_file)
                            if any(r.status is not RolloutStatus.INFRA_ERROR for r in group.rollouts):
                                failed_groups, any_ran = 0, True
                                continue
                            failed_groups += 1
                            if not any_ran and failed_groups >= AGENT_FAILED_GROUPS_BEFORE_STOP:
                                # A command that never works (a missing script, a module its interpreter
                                # lacks) would otherwise fill the run with refused groups to its budget.
                                error = next((r.error for r in group.rollouts if r.error), "no run made a call")
                                raise ConfigError(f"rollout.agent.command {rollout.agent.command!r} failed on "
                                                  f"every run of the first {failed_groups} groups: {error}")
            except AgentStartError as error:  # e.g. a preloaded module the command's interpreter lacks
                raise ConfigError(f"rollout.agent: {error}") from None

        def policy_pool_targets() -> list[str]:
            return servers.targets("policy") if servers is not None else policy_targets

        async def produce_step_groups(rollouts_file: IO[str], failures_file: IO[str]) -> None:
            """Each task admitted plays its step groups; each step group goes to the learner as a
            group of its own (one prompt, group_size completions)."""
            settings = AgentSettings(rollout.sampling, rollout.max_steps, rollout.max_tokens, rollout.retries,
                                     rollout.deadlines, rollout.options)
            tally = StepGroupTally()
            outcome.step_groups = tally.totals
            status.forks_opened = 0
            async for played in collect_step_tasks(tasks(), env=env, policy=policy,
                                                   grouping=rollout.step_groups.grouping(),
                                                   settings=settings, concurrency=rollout.concurrency):
                epoch = next_epoch(played.task)
                for group in played.groups:
                    send(group, epoch, rollouts_file, failures_file)
                rollouts_file.flush()
                await flow.task_finished(len(played.groups))
                tally.add(played)
                status.forks_opened, status.forks_closed = tally.totals["forks_opened"], tally.totals["forks_closed"]
                status.groups_generating = flow.in_flight

        # 3. The learner's events.
        async def handle(event: learner_pb2.TrainStepResponse) -> None:
            kind = event.WhichOneof("event")
            if kind == "receipt":
                receipt = event.receipt
                settled, again = ledger.on_receipt(receipt)
                if not receipt.accepted:
                    reason = receipt.reason
                    outcome.groups_refused[reason] = outcome.groups_refused.get(reason, 0) + 1
                    if reason == "invalid":
                        log.warning("learner refused group %s: %s", receipt.group_id, receipt.detail)
                if again:
                    learner.send_again_later(receipt.group_id)
                await flow.consume(settled)
            elif kind == "step":
                result = event.step
                await flow.consume(ledger.on_step(result))
                now = time.monotonic()
                sft = "sft_loss" in result.metrics
                record = StepRecord(
                    step=result.step,
                    policy_version=result.policy_version,
                    reward_mean=math.nan if sft else result.metrics.get("reward_mean", math.nan),
                    objective="sft" if sft else "grpo",
                    sft_loss=result.metrics.get("sft_loss"),
                    sft_token_accuracy=result.metrics.get("sft_token_accuracy"),
                    policy_lag_mean=result.metrics.get("policy_lag_mean", 0.0),
                    groups=result.groups,
                    seconds=now - started,
                    forks_opened=status.forks_opened,
                    forks_closed=status.forks_closed if status.forks_opened is not None else None,
                )
                status.step, status.policy_version = record.step, record.policy_version
                status.reward_mean, status.policy_lag_mean = record.reward_mean, record.policy_lag_mean
                status.sft_loss = record.sft_loss if sft else status.sft_loss
                status.last_step_at = now
                if status.first_step_s is None:
                    status.first_step_s = now - started
                outcome.steps.append(record)
                on_step(record, outcome)
                if reason := budget_spent(config.budget, outcome.steps):
                    outcome.stopped_by = outcome.stopped_by or reason
                    stop.set()
            elif kind == "step_failure":
                failure = event.step_failure
                outcome.step_failures += 1
                status.step_failures += 1
                log.warning(
                    "learner step failed (%s); %d of our groups went back, %d given up",
                    failure.error.message,
                    len(failure.returned_group_ids),
                    len(failure.abandoned_group_ids),
                )
                await flow.consume(ledger.on_step_failure(failure))
            else:
                log.warning("learner reported: %s", event.error.message)
            status.groups_in_learner = len(ledger.accepted)
            status.since_step = ledger.since_step
            status.equal_rewards = ledger.equal_rewards

        async def ticker() -> None:
            assert display is not None
            while True:
                status.groups_generating = flow.in_flight
                display.tick(status)
                await asyncio.sleep(1.0)

        async def watch(servers: Servers) -> None:
            """A role gone for good ends the run with the engine's one line."""
            while True:
                await asyncio.sleep(WATCH_INTERVAL_S)
                if (line := await asyncio.to_thread(servers.failure)) is not None:
                    raise ServerGone(line)

        async def deadline(seconds: float) -> None:
            await asyncio.sleep(seconds)
            outcome.stopped_by = outcome.stopped_by or "max_seconds"
            stop.set()

        # 4. Run until the budget is spent, `stop` is set or a part fails.
        with (
            (run_dir / "rollouts.jsonl").open("a", encoding="utf-8") as rollouts_file,
            (run_dir / "rollouts.failures.jsonl").open("w", encoding="utf-8") as failures_file,
        ):
            workers = [
                asyncio.create_task(produce(rollouts_file, failures_file), name="rollouts"),
                asyncio.create_task(learner.run(handle), name="learner stream"),
            ]
            if display is not None:
                workers.append(asyncio.create_task(ticker(), name="display"))
            if config.budget.max_seconds is not None:
                workers.append(asyncio.create_task(deadline(config.budget.max_seconds), name="deadline"))
            if servers is not None:
                workers.append(asyncio.create_task(watch(servers), name="servers"))
            stopper = asyncio.create_task(stop.wait())
            try:
                done, _ = await asyncio.wait([*workers, stopper], return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task is not stopper and task.exception() is not None:
                        error = task.exception()
                        raise from_rpc_error(error) if isinstance(error, grpc.RpcError) else error  # type: ignore[misc]
            finally:
                outcome.stopped_by = outcome.stopped_by or "interrupted"
                for task in [*workers, stopper]:
                    task.cancel()
                await asyncio.gather(*workers, stopper, return_exceptions=True)
                outcome.seconds = time.monotonic() - started
                outcome.generation_idle_s = flow.total_idle_s()
                outcome.groups_settled = dict(ledger.counts)
                outcome.groups_pending = len(ledger.unsettled)
                outcome.groups_resent = ledger.resent
                outcome.learner_reconnects = learner.reconnects
                outcome.group_fates = {g: fates or ["pending"] for g, fates in ledger.fates.items()}
                outcome.first_step_s = status.first_step_s
    return outcome


__all__ = ["run_rollouts_into_learner"]
