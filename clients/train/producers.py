"""Where `sciproto train`'s rollout groups come from: one producer per rollout mode.

A producer is an async function of one `Production`: it takes tasks from `production.tasks` (which
waits for room in the flow) and hands each finished group to `production.sink`, which writes it to
the rollout files, counts it and sends it to the learner. The modes:

- `produce_groups`: `samples` trajectories per task (rollout.grouping trajectory, the default);
- `produce_step_groups`: a task's step groups, played on forks of its episode (grouping step);
- `produce_agent_groups`: `samples` runs of an external agent program per task (rollout.agent);
- `produce_demonstrations`: the sft phases' demonstration groups, before any of the above.

`producer_for(config)` picks the one a configuration asks for; `produce` runs the phases and then it.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from clients.agent import AgentSettings, EnvPool, PolicyPool
from clients.agent_process import AgentProgram, AgentStartError, launcher
from clients.collect import collect, collect_step_tasks, fork_mode, split_size, stream_runs
from clients.curriculum import read_curriculum
from clients.external_agent import run_agent_group
from clients.train.config import RolloutSettings, TrainConfig
from clients.train.display import RunStatus
from clients.train.flow import Flow, GroupLedger
from clients.train.phases import sft_groups
from clients.train.records import StepGroupTally, TrainOutcome, group_to_pb, with_epoch
from clients.train.resume import resume_point, trained_group_ids
from clients.train.stream import LearnerStream
from clients.train.task_stats import TaskStats, restore_task_stats
from gateway.local import LocalGateway
from sciproto.client.rollouts import RolloutGroup, RolloutStatus, TaskKey
from sciproto.config import ConfigError
from sciproto.pb import env_pb2, learner_pb2

log = logging.getLogger(__name__)

# Groups whose every agent run failed, before any run worked, that stop the run as misconfigured.
AGENT_FAILED_GROUPS_BEFORE_STOP = 2


@dataclass
class TaskStream:
    """The tasks of the split (or the curriculum's tasks of it), cycled; each pass is an epoch, and a
    resumed run starts after the groups its learner trained. A task is admitted only when the flow
    has room for another group. A task set aside (clients.train.task_stats) is passed over, except
    with probability rollout.task_filter.revisit_prob, when a set-aside task is revisited in its
    place (the most promising one, or itself: `TaskStats.revisit_instead_of`); after a whole cycle
    passed over a revisit comes anyway, so refilling never waits on the filter."""

    env_name: str
    split: str
    size: int | None  # None: an unbounded split (any index is a task), which never repeats
    chosen: list[int] | None  # the curriculum's task indices
    start: int
    epochs: dict[TaskKey, int]
    flow: Flow
    status: RunStatus
    stats: TaskStats = field(default_factory=TaskStats)
    chance: random.Random = field(default_factory=lambda: random.Random(0))

    def task_at(self, number: int) -> TaskKey:
        if self.chosen is not None:
            return TaskKey(self.env_name, self.split, self.chosen[number % len(self.chosen)])
        return TaskKey(self.env_name, self.split, number if self.size is None else number % self.size)

    def turn(self, task: TaskKey, passed: int) -> TaskKey | None:
        """What `task`'s turn generates, `passed` tasks having been skipped in a row: `task`, a
        set-aside task revisited in its place, or nothing (None: passed over)."""
        if self.stats.set_aside(task) is None:
            self.stats.handed_out(task, revisit=False)
            return task
        cycle = len(self.chosen) if self.chosen is not None else self.size
        if cycle is not None and passed >= cycle:
            if not self.stats.revisited_all_set_aside:
                log.warning("every task of %s:%s is set aside (its last %d groups gave no signal): revisiting"
                            " %s; more tasks would give GRPO more to learn from", self.env_name, self.split,
                            self.stats.settings.window,
                            "the most promising" if self.stats.settings.revisit == "promising" else "them in turn")
            self.stats.revisited_all_set_aside += 1
        elif self.chance.random() >= self.stats.settings.revisit_prob:
            self.stats.passed_over += 1
            return None
        revisit = self.stats.revisit_instead_of(task, self.within)
        self.stats.handed_out(revisit, revisit=True)
        return revisit

    @functools.cached_property
    def within(self) -> frozenset[str] | None:
        """The group ids a revisit may pick from: the curriculum's tasks (None: any of the split)."""
        if self.chosen is None:
            return None
        return frozenset(TaskKey(self.env_name, self.split, index).group_id for index in self.chosen)

    async def stream(self) -> AsyncIterator[TaskKey]:
        passed = 0  # set-aside tasks skipped in a row
        for number in itertools.count(self.start):
            task = self.turn(self.task_at(number), passed)
            if task is None:
                passed += 1
                continue
            passed = 0
            await self.flow.admit()
            self.status.groups_generating = self.flow.in_flight
            yield task

    def next_epoch(self, task: TaskKey) -> int:
        epoch = self.epochs.get(task, 0)
        self.epochs[task] = epoch + 1
        return epoch


async def open_tasks(rollout: RolloutSettings, env: EnvPool, run_dir: Path, flow: Flow, status: RunStatus
                     ) -> TaskStream:
    """The run's tasks, after the groups its learner trained (a resumed run never re-sends one)."""
    env_name, split = rollout.split()
    size = await split_size(env, env_name, split, rollout.deadlines.describe_s)
    if rollout.grouping == "step":
        mode = await fork_mode(env, env_name, rollout.deadlines.describe_s)
        if mode == env_pb2.FORK_MODE_UNSUPPORTED:
            raise ConfigError(f"rollout.grouping step forks episodes, and environment {env_name!r} cannot fork"
                              " (Describe: fork unsupported); use grouping trajectory")
    curriculum = read_curriculum(rollout.curriculum) if rollout.curriculum else None
    point = resume_point(trained_group_ids(run_dir), env_name, split, size)
    if point.trained:
        log.info("resuming after %d trained groups of %s:%s", point.trained, env_name, split)
    stats = TaskStats(rollout.task_filter)
    if (step := restore_task_stats(stats, run_dir)) is not None:
        log.info("task statistics of step %d restored: %d tasks", step, len(stats.tasks))
    elif curriculum is not None and not point.trained:
        stats.seed(curriculum)
    status.tasks_set_aside = stats.summary()["set_aside"]
    return TaskStream(env_name, split, size, curriculum.indices if curriculum else None, point.start, point.epochs,
                      flow, status, stats, random.Random(point.start))


@dataclass
class GroupSink:
    """Where a finished group goes: the rollout files, the counts the display and the summary show,
    and the learner (whose stream keeps it in the ledger until it is settled)."""

    rollout: RolloutSettings
    learner: LearnerStream
    flow: Flow
    status: RunStatus
    outcome: TrainOutcome
    rollouts_file: IO[str]
    failures_file: IO[str]
    stats: TaskStats  # the task stream's, which judges the tasks by the groups counted here

    def send(self, group: RolloutGroup, epoch: int) -> None:
        """Write a finished group's records, count its outcome for its task and send it to the
        learner (in the ledger)."""
        group_id, records = with_epoch(group, epoch)
        self.stats.record(group)
        self.status.tasks_set_aside = len(self.stats.aside)
        for record in records:
            sink = self.failures_file if record.status is RolloutStatus.INFRA_ERROR else self.rollouts_file
            sink.write(record.to_json_line(self.rollout.rollouts_file))
        self.outcome.groups_generated += 1
        self.outcome.completion_tokens += sum(r.tokens.completion for r in records)
        self.status.groups_finished = self.outcome.groups_generated
        self.status.rollouts_finished += len(records)
        self.status.completion_tokens = self.outcome.completion_tokens
        self.learner.send(learner_pb2.TrainStepRequest(group=group_to_pb(group_id, records)))

    def deliver(self, group: RolloutGroup, epoch: int) -> None:
        """A finished trajectory group: to the learner and the rollout files."""
        self.flow.group_finished()
        self.send(group, epoch)
        self.rollouts_file.flush()
        self.failures_file.flush()
        self.status.groups_generating = self.flow.in_flight


@dataclass
class Production:
    """What every producer works with."""

    config: TrainConfig
    env: EnvPool
    policy: PolicyPool
    policy_targets: Callable[[], list[str]]  # where the policy servers listen now (for a gateway)
    tasks: TaskStream
    sink: GroupSink
    ledger: GroupLedger
    run_dir: Path
    started: float

    @property
    def rollout(self) -> RolloutSettings:
        return self.config.rollout

    @property
    def adapter(self) -> str:
        """The LoRA adapter the learner trains and every Generate samples with ("": full weights)."""
        lora = self.config.learner.lora
        return lora.name if lora is not None else ""


Producer = Callable[[Production], Awaitable[None]]


async def produce_groups(production: Production) -> None:
    """rollout.grouping trajectory: `samples` episodes per task, a group each."""
    rollout, sink = production.rollout, production.sink
    async for group in collect(
        production.tasks.stream(),
        env=production.env,
        policy=production.policy,
        samples=rollout.samples,
        concurrency=rollout.concurrency,
        sampling=rollout.sampling,
        max_steps=rollout.max_steps,
        max_tokens=rollout.max_tokens,
        retries=rollout.retries,
        deadlines=rollout.deadlines,
        options=rollout.options,
        adapter=production.adapter,
    ):
        sink.deliver(group, production.tasks.next_epoch(group.task))


async def produce_step_groups(production: Production) -> None:
    """Each task admitted plays its step groups; each step group goes to the learner as a group of
    its own (one prompt, group_size completions)."""
    rollout, sink, status, flow = production.rollout, production.sink, production.sink.status, production.sink.flow
    settings = AgentSettings(rollout.sampling, rollout.max_steps, rollout.max_tokens, rollout.retries,
                             rollout.deadlines, rollout.options, production.adapter)
    tally = StepGroupTally()
    sink.outcome.step_groups = tally.totals
    status.forks_opened = 0
    async for played in collect_step_tasks(production.tasks.stream(), env=production.env, policy=production.policy,
                                           grouping=rollout.step_groups.grouping(),
                                           settings=settings, concurrency=rollout.concurrency):
        epoch = production.tasks.next_epoch(played.task)
        for group in played.groups:
            sink.send(group, epoch)
        sink.rollouts_file.flush()
        await flow.task_finished(len(played.groups))
        tally.add(played)
        status.forks_opened, status.forks_closed = tally.totals["forks_opened"], tally.totals["forks_closed"]
        status.groups_generating = flow.in_flight


async def produce_agent_groups(production: Production) -> None:
    """rollout.agent: each task admitted is `samples` runs of the external program, each in a
    session of a gateway on the run's policy servers, graded by the env's Verify
    (clients.external_agent); the group goes to the learner like any other."""
    rollout, env = production.rollout, production.env
    agent = rollout.agent
    assert agent is not None
    program = AgentProgram(agent.command, agent.timeout_s, tuple(agent.preload))

    @contextlib.asynccontextmanager
    async def lease() -> AsyncIterator[Any]:
        async with env.lease() as replica:
            yield replica.client

    try:
        async with (LocalGateway(production.policy_targets(), adapter=production.adapter) as gateway,
                    launcher(program) as launch):
            groups = stream_runs(production.tasks.stream(), max(1, rollout.concurrency // rollout.samples),
                                 lambda task: run_agent_group(gateway, lease, launch, task, rollout.samples,
                                                              rollout.options))
            failed_groups, any_ran = 0, False  # groups in a row whose every run failed
            async with contextlib.aclosing(groups):
                async for group in groups:
                    production.sink.deliver(group, production.tasks.next_epoch(group.task))
                    if any(r.status is not RolloutStatus.INFRA_ERROR for r in group.rollouts):
                        failed_groups, any_ran = 0, True
                        continue
                    failed_groups += 1
                    if not any_ran and failed_groups >= AGENT_FAILED_GROUPS_BEFORE_STOP:
                        # A command that never works (a missing script, a module its interpreter
                        # lacks) would otherwise fill the run with refused groups to its budget.
                        error = next((r.error for r in group.rollouts if r.error), "no run made a call")
                        raise ConfigError(f"rollout.agent.command {agent.command!r} failed on "
                                          f"every run of the first {failed_groups} groups: {error}")
    except AgentStartError as error:  # e.g. a preloaded module the command's interpreter lacks
        raise ConfigError(f"rollout.agent: {error}") from None


async def produce_demonstrations(production: Production) -> None:
    """The sft phases: every demonstration group not trained before, then a wait until the learner
    has settled them all (clients.train.phases)."""
    config, sink, flow, status = production.config, production.sink, production.sink.flow, production.sink.status
    pending = sft_groups(config.phases, config.learner.batch_groups, trained_group_ids(production.run_dir))
    status.phase = "sft"
    for group in pending:
        await flow.admit()
        sink.learner.send(learner_pb2.TrainStepRequest(group=group_to_pb(
            group.group_id, [group.record], learner_pb2.TRAIN_OBJECTIVE_SFT)))
        flow.group_finished()
        sink.outcome.demonstrations_sent += 1
    async with flow.changed:
        await flow.changed.wait_for(lambda: not any(g.group_id in production.ledger.unsettled for g in pending))
    status.phase = "grpo"
    status.generating_since = time.monotonic()
    sink.outcome.sft_seconds = status.generating_since - production.started


def producer_for(rollout: RolloutSettings) -> Producer:
    """The producer of the rollout mode a configuration asks for."""
    if rollout.grouping == "step":
        return produce_step_groups
    if rollout.agent is not None:
        return produce_agent_groups
    return produce_groups


async def produce(production: Production, stop_with: Callable[[str], None]) -> None:
    """The sft phases, if any; then, unless the run is phases only, the rollout mode's groups."""
    config = production.config
    if config.phases:
        await produce_demonstrations(production)
        if not config.runs_grpo:
            stop_with("phases")
            return
    await producer_for(config.rollout)(production)


__all__ = ["GroupSink", "Producer", "Production", "TaskStream", "open_tasks", "produce", "produce_agent_groups",
           "produce_demonstrations", "produce_groups", "produce_step_groups", "producer_for"]
