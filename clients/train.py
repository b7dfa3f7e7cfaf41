"""`sciproto train`: one command that trains end to end on this machine.

    sciproto train --config demo [--set learner.grpo.lr=1e-3 ...]

1. Starts an env server, a policy server and the learner as child processes (logs in the run
   directory), all from the sections of one config file (`env`, `policy`, `learner`).
2. Runs the rollout client here: `collect(...)` over the task split, cycled, streams every finished
   group into the learner's TrainStep stream. Generation goes on while the learner trains (async
   GRPO), but at most `rollout.max_groups_ahead` groups are started and not yet consumed by the
   learner (trained, dropped or refused): with max_staleness 0 and one batch ahead, this is
   synchronous on-policy GRPO.
3. Stops at the budget (optimizer steps and/or seconds) or on Ctrl-C: stops every child (SIGTERM,
   then SIGKILL after processes.stop_timeout_s), the learner first, which finishes the step in
   flight and writes its final checkpoint; then prints a summary that agrees with that checkpoint
   and metrics.jsonl (a step that finished after the stop is counted).

A run directory `runs/<name>` holds: config.yaml (as resolved), env.log / policy.log /
learner.log, checkpoints/, metrics.jsonl, reward.png, rollouts.jsonl (the rollout line format of
`clients.rollouts`; `sciproto view` opens it), rollouts.failures.jsonl and summary.json.
Each pass over the split is an epoch; a group's id is `<env>/<split>/<index>#<epoch>` (its
rollouts' ids add `/<sample>`), so the learner's duplicate check refuses only true retries. With
`rollout.grouping: step` a task gives one group per step group (clients.step_rollouts), each id
adding `/step<k>`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import signal
import statistics
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import IO, Literal

import grpc
from pydantic import BaseModel, ConfigDict, Field, model_validator
from rich.console import Console
from rich.table import Table

from clients import resume
from clients.agent import AgentSettings, ResetOptions, Sampling, env_pool, policy_pool
from clients.collect import collect, collect_step_tasks, fork_mode, split_size
from clients.curriculum import read_curriculum
from clients.retries import Deadlines, RetryPolicy
from clients.rollouts import (
    FINISH_REASON_TO_PB,
    RolloutDetail,
    RolloutGroup,
    RolloutRecord,
    RolloutStatus,
    TaskKey,
)
from clients.step_rollouts import StepGroupSettings
from clients.train_display import Progress, RunStatus
from clients.train_flow import Flow, GroupLedger
from clients.train_processes import start_servers, stop_servers
from clients.train_record import learner_record
from env_servers.catalog import check_name
from env_servers.config import EnvServerConfig
from learner.metrics import METRICS_FILE, PLOT_FILE, plot_metrics, read_metrics
from learner.server_config import LearnerServerConfig
from policy_server.config import PolicyServerConfig
from sciproto.channel import make_channel
from sciproto.config import ConfigError, load_config
from sciproto.errors import Unavailable, from_rpc_error
from sciproto.pb import common_pb2, env_pb2, learner_grpc, learner_pb2
from sciproto.processes import ServerProcess

log = logging.getLogger(__name__)

# Ctrl-C, or a supervisor's polite stop: both end the run cleanly with every output written.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

# A broken TrainStep stream with one of these codes is opened again (the learner restarts).
RECONNECT_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
                   grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED)
BUSY_RESEND_S = 1.0  # wait before sending again a group the learner had no room for

_STATUS_TO_PB = {
    RolloutStatus.SCORED: common_pb2.REWARD_STATUS_SCORED,
    RolloutStatus.UNSCORED: common_pb2.REWARD_STATUS_UNSCORED,
    RolloutStatus.INFRA_ERROR: common_pb2.REWARD_STATUS_INFRA_ERROR,
}


# ---------------------------------------------------------------------- configuration


class RunSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field("demo", description="Run name; the run directory is <dir>/<name>")
    dir: Path = Field(Path("runs"), description="Parent of run directories")
    resume: bool = Field(
        True,
        description=(
            "Continue the latest run of this name that holds a checkpoint (<dir>/<name> or its"
            " highest <name>-N); false (`sciproto train --fresh`) starts over, in a numbered"
            " sibling (<name>-2, ...) when <dir>/<name> is taken"
        ),
    )


class Budget(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_steps: int | None = Field(
        30, ge=1, description="Stop after this many optimizer steps (learner total)"
    )
    max_seconds: float | None = Field(
        None, gt=0, description="Stop after this many seconds of training"
    )
    # Once a policy scores near the maximum, most groups carry no signal (all rewards equal) and
    # each further step waits long for data: a run that reached its goal may as well stop.
    target_reward: float | None = Field(
        None, description="Stop once the mean reward of the last `target_window` steps reaches this"
    )
    target_window: int = Field(3, ge=1, description="Steps averaged for target_reward")

    @model_validator(mode="after")
    def _some_limit(self) -> Budget:
        if self.max_steps is None and self.max_seconds is None:
            raise ValueError(
                "budget needs max_steps or max_seconds (or both); an unbounded run never ends"
            )
        return self


class RolloutSettings(BaseModel):
    """The in-process rollout client."""

    model_config = ConfigDict(extra="forbid")

    tasks: str = Field("toy:train", description="ENV:SPLIT, cycled over")
    curriculum: Path | None = Field(
        None,
        description="A curriculum file (`sciproto eval --write-curriculum`): cycle over its tasks of the split only",
    )
    samples: int = Field(8, ge=2, description="Samples per task: one GRPO group (grouping trajectory)")
    grouping: Literal["trajectory", "step"] = Field(
        "trajectory",
        description=(
            "trajectory: a group is `samples` whole episodes of a task; step: a group is the"
            " alternatives of one step, sampled on forks of the episode (see step_groups)"
        ),
    )
    step_groups: StepGroupSettings = Field(default_factory=StepGroupSettings)
    observation: Literal["history", "state"] | None = Field(
        None,
        description=(
            "The notebook env's context policy, sent with every Reset (unset: the env's default,"
            " history); state needs grouping step"
        ),
    )
    reset_options: ResetOptions = Field(
        default_factory=dict,
        description=(
            "More per-episode env options sent with every Reset (notebook: action: code, cell_reward: 0.1);"
            " the environment checks them"
        ),
    )
    concurrency: int = Field(64, ge=1, description="Episodes in flight at once")
    max_groups_ahead: int | None = Field(
        None,
        ge=1,
        description=(
            "Groups started and not yet consumed by the learner; default (max_staleness + 1) x batch_groups"
        ),
    )
    sampling: Sampling = Field(default_factory=Sampling)
    max_steps: int = Field(8, ge=1, description="Most environment Steps per episode")
    max_tokens: int = Field(4096, ge=1, description="Most tokens per trajectory")
    rollouts_file: RolloutDetail = Field(
        "full", description="rollouts.jsonl lines: full (token arrays too) or summary (see clients.rollouts)"
    )
    retries: RetryPolicy = Field(default_factory=RetryPolicy)
    deadlines: Deadlines = Field(default_factory=Deadlines)
    learner_reconnect_s: float = Field(
        300.0,
        gt=0,
        description=(
            "Longest the learner may stay unreachable (restarting) before the run fails; its "
            "unsettled groups are sent again once it is back"
        ),
    )

    @model_validator(mode="after")
    def _state_view_trains_by_step(self) -> RolloutSettings:
        if self.options.get("observation") == "state" and self.grouping != "step":
            raise ValueError(
                "rollout.observation state needs rollout.grouping step: a state-view episode's turns"
                " do not extend one another, so they cannot train as one trajectory"
            )
        return self

    @property
    def options(self) -> dict[str, str]:
        """The env options of every Reset."""
        return {**self.reset_options, **({"observation": self.observation} if self.observation else {})}

    def split(self) -> tuple[str, str]:
        env, sep, split = self.tasks.partition(":")
        if not sep or not env or not split:
            raise ConfigError(
                f"rollout.tasks {self.tasks!r} must look like ENV:SPLIT, e.g. toy:train"
            )
        return env, split


class ProcessSettings(BaseModel):
    """How the child processes start."""

    model_config = ConfigDict(extra="forbid")

    start_timeout_s: float = Field(
        300.0, gt=0, description="Longest wait for a server to announce its port"
    )
    stop_timeout_s: float = Field(
        120.0, gt=0, description="Longest wait after SIGTERM before SIGKILL"
    )
    # CPU threads of each server's torch/OpenMP pools (0: library default). On a small CPU, one
    # thread each lets generation and training run side by side instead of fighting for cores.
    policy_threads: int = Field(0, ge=0)
    learner_threads: int = Field(0, ge=0)
    # CPU cores each server may run on (taskset; empty: any). Giving generation (policy) and
    # training (learner) cores of their own lets them overlap instead of time-sharing.
    env_cpus: list[int] = Field(default_factory=list)
    policy_cpus: list[int] = Field(default_factory=list)
    learner_cpus: list[int] = Field(default_factory=list)


class DisplaySettings(BaseModel):
    """What the run shows besides the live line."""

    model_config = ConfigDict(extra="forbid")

    stall_after_s: float = Field(
        60.0, gt=0, description="Say why when no optimizer step has run for this long"
    )


class TrainConfig(BaseModel):
    """Everything `sciproto train` needs: one file configures every component."""

    model_config = ConfigDict(extra="forbid")

    run: RunSettings = Field(default_factory=RunSettings)
    budget: Budget = Field(default_factory=Budget)
    env: EnvServerConfig = Field(default_factory=lambda: EnvServerConfig(envs=["toy"]))
    policy: PolicyServerConfig = Field(default_factory=PolicyServerConfig)
    learner: LearnerServerConfig = Field(default_factory=LearnerServerConfig)
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    processes: ProcessSettings = Field(default_factory=ProcessSettings)
    progress: bool = Field(True, description="Show a live progress line")
    display: DisplaySettings = Field(default_factory=lambda: DisplaySettings())

    @model_validator(mode="after")
    def _learner_trains_the_served_model(self) -> TrainConfig:
        # The learner must build exactly the weights the policy server starts from.
        self.learner.model = self.policy.model
        self.learner.model_seed = self.policy.seed
        # ... and train the policy that sampled: the tempered one (greedy rollouts report T = 1).
        sampled_at = self.rollout.sampling.temperature or 1.0
        grpo = self.learner.grpo
        if "temperature" not in grpo.model_fields_set:
            grpo.temperature = sampled_at
        elif grpo.temperature != sampled_at:
            raise ValueError(
                f"learner.grpo.temperature {grpo.temperature} differs from rollout.sampling.temperature"
                f" {self.rollout.sampling.temperature}: the learner must train the policy that sampled;"
                " leave learner.grpo.temperature unset and it follows the rollouts"
            )
        env, _ = self.rollout.split()
        if self.rollout.curriculum is not None:
            curriculum = read_curriculum(self.rollout.curriculum)
            if curriculum.tasks != self.rollout.tasks:
                raise ValueError(
                    f"rollout.curriculum {self.rollout.curriculum} lists tasks of {curriculum.tasks},"
                    f" but rollout.tasks is {self.rollout.tasks}"
                )
        if env not in self.env.envs:
            raise ValueError(
                f"rollout.tasks uses environment {env!r} but env.envs is {self.env.envs}"
            )
        return self

    @property
    def max_groups_ahead(self) -> int:
        if self.rollout.max_groups_ahead is not None:
            return self.rollout.max_groups_ahead
        return (self.learner.grpo.max_staleness + 1) * self.learner.batch_groups


def load_train_config(config: str | Path, overrides: Sequence[str] = ()) -> TrainConfig:
    return load_config(TrainConfig, config, list(overrides))


def check_envs(names: Sequence[str]) -> None:
    """Refuse, before any server starts, an environment the env server could not host."""
    for name in names:
        try:
            check_name(name)
        except ValueError as error:
            raise ConfigError(f"env.envs: {error}") from None


def choose_run_dir(run: RunSettings) -> Path:
    """The run directory: see `clients.resume.choose_run_dir`."""
    return resume.choose_run_dir(run.dir, run.name, run.resume)


# ---------------------------------------------------------------------- rollouts -> learner


def rollout_to_pb(record: RolloutRecord) -> learner_pb2.Rollout:
    """The learner's message for one rollout record, finish reasons and step rewards included."""
    return learner_pb2.Rollout(
        sample_index=record.sample,
        token_ids=record.token_ids,
        loss_mask=record.loss_mask,
        rollout_logprobs=record.logprobs,
        version_spans=[
            common_pb2.VersionSpan(start=s, end=e, policy_version=v)
            for s, e, v in record.version_spans
        ],
        reward=common_pb2.Reward(
            value=record.reward,
            components=record.reward_components,
            status=_STATUS_TO_PB[record.status],
            detail=record.reward_detail or (record.error or ""),
        ),
        turns=record.steps,
        turn_finish_reasons=[FINISH_REASON_TO_PB[reason] for reason in record.turn_finish_reasons],
        step_rewards=record.step_rewards,
    )


def group_to_pb(group_id: str, records: Sequence[RolloutRecord]) -> learner_pb2.RolloutGroup:
    """The learner's message for one group; rollouts without tokens (failed before the policy
    spoke) carry nothing to train and are left out."""
    first = records[0]
    return learner_pb2.RolloutGroup(
        group_id=group_id,
        env=first.env,
        task_id=f"{first.split}/{first.index}",
        rollouts=[rollout_to_pb(r) for r in records if r.token_ids],
    )


def with_epoch(group: RolloutGroup, epoch: int) -> tuple[str, list[RolloutRecord]]:
    """The group's id for this pass over the split, and its records renamed to match: a step
    group's id adds its step, `<env>/<split>/<index>#<epoch>/step<k>`."""
    group_id = f"{group.task.group_id}#{epoch}" + ("" if group.step is None else f"/step{group.step}")
    records = [
        r.model_copy(update={"group_id": group_id, "rollout_id": f"{group_id}/{r.sample}"})
        for r in group.rollouts
    ]
    return group_id, records


# ---------------------------------------------------------------------- the loop


class StepRecord(BaseModel):
    step: int
    policy_version: int
    reward_mean: float
    policy_lag_mean: float
    groups: int
    seconds: float  # since training started
    # rollout.grouping step: forks opened and closed by the rollout client up to this step.
    forks_opened: int | None = None
    forks_closed: int | None = None


class TrainOutcome(BaseModel):
    """What a run did; written to summary.json."""

    run_dir: str
    steps: list[StepRecord] = []
    seconds: float = 0.0
    groups_generated: int = 0
    groups_refused: dict[str, int] = {}
    # What became of the groups generated (see clients.train_flow): fate -> groups, and the
    # groups still unsettled when the run stopped (generated, not yet consumed or dropped).
    groups_settled: dict[str, int] = {}
    groups_pending: int = 0
    groups_resent: int = 0  # sent again on a new stream after the learner's stream broke
    learner_reconnects: int = 0
    step_failures: int = 0  # learner steps that failed and gave their groups back
    first_step_s: float | None = None  # seconds to the first optimizer step result
    # rollout.grouping step: forks_opened, forks_closed, step_groups, step_group_reward_std (mean
    # over groups), prompt_tokens_per_turn_mean / _max (every Generate), tasks_failed.
    step_groups: dict[str, float] = {}
    # Every fate the client recorded per group id (one each); not written to summary.json.
    group_fates: dict[str, list[str]] = Field(default_factory=dict, exclude=True)
    completion_tokens: int = 0
    # Seconds during which no group was being generated (the rollout client waited on the learner).
    generation_idle_s: float = 0.0
    stopped_by: str = ""
    checkpoint: str = ""
    metrics: str = ""
    plot: str = ""
    rollouts: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds else 0.0

    def reward_at(self, fraction_from: float, fraction_to: float) -> float:
        """Mean reward of the steps in [fraction_from, fraction_to) of the run's steps."""
        chosen = self.steps[
            int(len(self.steps) * fraction_from) : max(1, int(len(self.steps) * fraction_to))
        ]
        return sum(s.reward_mean for s in chosen) / len(chosen) if chosen else math.nan


def budget_spent(budget: Budget, steps: Sequence[StepRecord]) -> str:
    """Which step limit of the budget the run has reached ("" while none)."""
    if budget.max_steps is not None and steps and steps[-1].step >= budget.max_steps:
        return "max_steps"
    recent = steps[-budget.target_window :]
    if (
        budget.target_reward is not None
        and len(recent) == budget.target_window
        and sum(s.reward_mean for s in recent) / len(recent) >= budget.target_reward
    ):
        return "target_reward"
    return ""


async def run_rollouts_into_learner(
    config: TrainConfig,
    env_target: str,
    policy_target: str,
    learner_target: str,
    run_dir: Path,
    stop: asyncio.Event,
    on_step: Callable[[StepRecord, TrainOutcome], None] = lambda *_: None,
    display: Progress | None = None,
) -> TrainOutcome:
    """Stream rollout groups into the learner until the budget is spent or `stop` is set.

    Every group stays in a ledger (clients.train_flow) until the learner settles it; a broken
    TrainStep stream is opened again (for up to rollout.learner_reconnect_s) and every unsettled
    group is sent again on it."""
    rollout = config.rollout
    env_name, split = rollout.split()
    flow = Flow(config.max_groups_ahead)
    ledger = GroupLedger()
    status = RunStatus(batch_groups=config.learner.batch_groups)
    outcome = TrainOutcome(run_dir=str(run_dir))
    outgoing: asyncio.Queue[learner_pb2.TrainStepRequest] = asyncio.Queue()
    started = time.monotonic()
    run_dir.mkdir(parents=True, exist_ok=True)

    async with env_pool([env_target]) as env, policy_pool([policy_target]) as policy:
        size = await split_size(env, env_name, split, rollout.deadlines.describe_s)
        if rollout.grouping == "step":
            mode = await fork_mode(env, env_name, rollout.deadlines.describe_s)
            if mode == env_pb2.FORK_MODE_UNSUPPORTED:
                raise ConfigError(f"rollout.grouping step forks episodes, and environment {env_name!r} cannot fork"
                                  " (Describe: fork unsupported); use grouping trajectory")
        chosen = read_curriculum(rollout.curriculum).indices if rollout.curriculum else None
        # A resumed run continues after the groups its learner trained, never re-sending one.
        point = resume.resume_point(resume.trained_group_ids(run_dir), env_name, split, size)
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

        def send(group: RolloutGroup, epoch: int, rollouts_file: IO[str], failures_file: IO[str]) -> None:
            """Write a finished group's records and queue it for the learner (in the ledger)."""
            group_id, records = with_epoch(group, epoch)
            for record in records:
                sink = failures_file if record.status is RolloutStatus.INFRA_ERROR else rollouts_file
                sink.write(record.to_json_line(rollout.rollouts_file))
            outcome.groups_generated += 1
            outcome.completion_tokens += sum(r.tokens.completion for r in records)
            status.groups_finished = outcome.groups_generated
            status.rollouts_finished += len(records)
            status.completion_tokens = outcome.completion_tokens
            request = learner_pb2.TrainStepRequest(group=group_to_pb(group_id, records))
            ledger.add(request)
            outgoing.put_nowait(request)

        def next_epoch(task: TaskKey) -> int:
            epoch = epochs.get(task, 0)
            epochs[task] = epoch + 1
            return epoch

        async def produce(rollouts_file: IO[str], failures_file: IO[str]) -> None:
            if rollout.grouping == "step":
                await produce_step_groups(rollouts_file, failures_file)
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
                flow.group_finished()
                send(group, next_epoch(group.task), rollouts_file, failures_file)
                rollouts_file.flush()
                failures_file.flush()
                status.groups_generating = flow.in_flight

        async def produce_step_groups(rollouts_file: IO[str], failures_file: IO[str]) -> None:
            """Each task admitted plays its step groups; each step group goes to the learner as a
            group of its own (one prompt, group_size completions)."""
            settings = AgentSettings(rollout.sampling, rollout.max_steps, rollout.max_tokens, rollout.retries,
                                     rollout.deadlines, rollout.options)
            grouping = rollout.step_groups.grouping()
            totals = outcome.step_groups = {"forks_opened": 0, "forks_closed": 0, "step_groups": 0,
                                            "tasks_failed": 0}
            reward_stds: list[float] = []
            prompt_tokens: list[int] = []
            status.forks_opened = 0
            async for played in collect_step_tasks(tasks(), env=env, policy=policy, grouping=grouping,
                                                   settings=settings, concurrency=rollout.concurrency):
                epoch = next_epoch(played.task)
                for group in played.groups:
                    send(group, epoch, rollouts_file, failures_file)
                rollouts_file.flush()
                await flow.task_finished(len(played.groups))
                totals["forks_opened"] += played.stats.forks_opened
                totals["forks_closed"] += played.stats.forks_closed
                totals["step_groups"] += played.stats.groups
                totals["tasks_failed"] += played.error is not None
                if played.context_full is not None and not played.groups:
                    totals["tasks_context_full"] = totals.get("tasks_context_full", 0) + 1
                    if totals["tasks_context_full"] == 1:
                        log.warning("%s: its first prompt does not fit the model, so it gives no step group: %s",
                                    played.task.group_id, played.context_full)
                reward_stds += played.stats.reward_stds
                prompt_tokens += played.prompt_tokens
                totals["step_group_reward_std"] = sum(reward_stds) / len(reward_stds) if reward_stds else 0.0
                if prompt_tokens:
                    totals["prompt_tokens_per_turn_mean"] = sum(prompt_tokens) / len(prompt_tokens)
                    totals["prompt_tokens_per_turn_max"] = max(prompt_tokens)
                status.forks_opened, status.forks_closed = totals["forks_opened"], totals["forks_closed"]
                status.groups_generating = flow.in_flight

        async def send_again_later(request: learner_pb2.TrainStepRequest) -> None:
            await asyncio.sleep(BUSY_RESEND_S)
            if request.group.group_id in ledger.unsettled:
                outgoing.put_nowait(request)

        async def requests() -> AsyncIterator[learner_pb2.TrainStepRequest]:
            """One stream's messages: every unsettled group first, then new ones."""
            while not outgoing.empty():
                outgoing.get_nowait()  # each is in the ledger, and sent below
            for request in ledger.to_resend():
                yield request
            while True:
                request = await outgoing.get()
                if request.group.group_id in ledger.unsettled:
                    ledger.sent.add(request.group.group_id)
                    yield request

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
                    background.add(asyncio.ensure_future(send_again_later(
                        ledger.unsettled[receipt.group_id])))
                await flow.consume(settled)
            elif kind == "step":
                result = event.step
                metrics = result.metrics
                await flow.consume(ledger.on_step(result))
                now = time.monotonic()
                record = StepRecord(
                    step=result.step,
                    policy_version=result.policy_version,
                    reward_mean=metrics.get("reward_mean", math.nan),
                    policy_lag_mean=metrics.get("policy_lag_mean", 0.0),
                    groups=result.groups,
                    seconds=now - started,
                    forks_opened=status.forks_opened,
                    forks_closed=status.forks_closed if status.forks_opened is not None else None,
                )
                status.step, status.policy_version = record.step, record.policy_version
                status.reward_mean, status.policy_lag_mean = record.reward_mean, record.policy_lag_mean
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

        async def learner_stream(channel: grpc.aio.Channel) -> None:
            """TrainStep, opened again while the learner restarts (bounded)."""
            stub = learner_grpc.LearnerServiceStub(channel)
            backoff = 0.5
            while True:
                call = stub.TrainStep(requests())
                try:
                    async for event in call:
                        if status.learner_down_since is not None:
                            log.warning("learner reachable again; unsettled groups were sent again")
                        status.learner_down_since, backoff = None, 0.5
                        await handle(event)
                    error_text = "the learner ended the stream"
                except grpc.RpcError as error:
                    if error.code() not in RECONNECT_CODES:
                        raise
                    error_text = f"{error.code().name}: {error.details()}"
                finally:
                    call.cancel()
                now = time.monotonic()
                if status.learner_down_since is None:
                    status.learner_down_since = now
                    outcome.learner_reconnects += 1
                    log.warning("learner stream broke (%s); reconnecting", error_text)
                elif now - status.learner_down_since > rollout.learner_reconnect_s:
                    raise Unavailable(
                        f"the learner at {learner_target} stayed unreachable for "
                        f"{rollout.learner_reconnect_s:.0f} s ({error_text}); see learner.log"
                    )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

        async def ticker() -> None:
            assert display is not None
            while True:
                status.groups_generating = flow.in_flight
                display.tick(status)
                await asyncio.sleep(1.0)

        async def deadline(seconds: float) -> None:
            await asyncio.sleep(seconds)
            outcome.stopped_by = outcome.stopped_by or "max_seconds"
            stop.set()

        background: set[asyncio.Future[None]] = set()
        channel = make_channel(learner_target)
        with (
            (run_dir / "rollouts.jsonl").open("a", encoding="utf-8") as rollouts_file,
            (run_dir / "rollouts.failures.jsonl").open("w", encoding="utf-8") as failures_file,
        ):
            workers = [
                asyncio.create_task(produce(rollouts_file, failures_file), name="rollouts"),
                asyncio.create_task(learner_stream(channel), name="learner stream"),
            ]
            if display is not None:
                workers.append(asyncio.create_task(ticker(), name="display"))
            if config.budget.max_seconds is not None:
                workers.append(
                    asyncio.create_task(deadline(config.budget.max_seconds), name="deadline")
                )
            stopper = asyncio.create_task(stop.wait())
            try:
                done, _ = await asyncio.wait(
                    [*workers, stopper], return_when=asyncio.FIRST_COMPLETED
                )
                for task in done:
                    if task is not stopper and task.exception() is not None:
                        error = task.exception()
                        raise from_rpc_error(error) if isinstance(error, grpc.RpcError) else error  # type: ignore[misc]
            finally:
                outcome.stopped_by = outcome.stopped_by or "interrupted"
                for task in [*workers, stopper, *background]:
                    task.cancel()
                await asyncio.gather(*workers, stopper, *background, return_exceptions=True)
                outcome.seconds = time.monotonic() - started
                outcome.generation_idle_s = flow.total_idle_s()
                outcome.groups_settled = dict(ledger.counts)
                outcome.groups_pending = len(ledger.unsettled)
                outcome.groups_resent = ledger.resent
                outcome.group_fates = {
                    g: fates or ["pending"] for g, fates in ledger.fates.items()
                }
                outcome.first_step_s = status.first_step_s
                await channel.close()
    return outcome


# ---------------------------------------------------------------------- the command


def train(config: TrainConfig) -> TrainOutcome:
    """Run a whole training job (see the module docstring) and return what it did."""
    run_dir = choose_run_dir(config.run)
    done, limit = resume.trained_steps(run_dir), config.budget.max_steps
    if limit is not None and done >= limit:
        raise ConfigError(f"{run_dir} has trained {done} steps already (budget.max_steps={limit}): raise"
                          " budget.max_steps to continue it, or pass --fresh to start over")
    run_dir.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True)
    console.print(f"[bold]sciproto train[/bold]: run directory {run_dir}")
    processes = start_servers(config, run_dir)
    outcome = TrainOutcome(run_dir=str(run_dir), stopped_by="aborted")
    progress = Progress(config.budget.max_steps, config.progress, config.display.stall_after_s,
                        config.budget.max_seconds)
    try:
        outcome = asyncio.run(_train_async(config, processes, run_dir, progress))
    finally:
        progress.close()
        # The learner first: on SIGTERM it finishes the step in flight (within stop_timeout_s),
        # logs it and writes its final checkpoint, which the summary then agrees with.
        stop_servers(processes, config.processes.stop_timeout_s)
        settle_with_learner(outcome, run_dir, resumed_at=done)
        _finish_outputs(outcome, run_dir)
    return outcome


def settle_with_learner(outcome: TrainOutcome, run_dir: Path, resumed_at: int) -> None:
    """Make the summary agree with what the stopped learner kept (clients.train_record): a step
    that was training when the run stopped finished after the TrainStep stream ended, so no step
    result told of it; its metrics line and the final checkpoint do. Steps the client heard of
    beyond that checkpoint (a learner killed between checkpoints) are lost and trained again by a
    resumed run: they leave the summary too. `resumed_at`: the step the run started from."""
    kept = learner_record(run_dir)
    if kept is None:
        return
    lost = [s.step for s in outcome.steps if s.step > kept.step]
    if lost:
        log.warning("steps %s are not in the learner's last checkpoint (step %d): a resumed run "
                    "trains them again", lost, kept.step)
    heard = {s.step: s for s in outcome.steps if s.step <= kept.step}
    for line in kept.metrics:
        step = int(line["step"])
        if step > resumed_at and step not in heard:  # finished after the stream ended
            heard[step] = StepRecord(
                step=step,
                policy_version=int(line.get("policy_version", step)),
                reward_mean=float(line.get("reward_mean", math.nan)),
                policy_lag_mean=float(line.get("policy_lag_mean", 0.0)),
                groups=int(line.get("groups", 0)),
                seconds=outcome.seconds,
            )
    outcome.steps = [heard[step] for step in sorted(heard)]
    for group_id, fates in outcome.group_fates.items():
        if fates != ["pending"]:
            continue
        fate = ("consumed" if group_id in kept.trained_group_ids
                else "dropped_stale" if group_id in kept.dropped_stale_group_ids else None)
        if fate is not None:
            fates[:] = [fate]
            outcome.groups_settled[fate] = outcome.groups_settled.get(fate, 0) + 1
            outcome.groups_pending -= 1
    outcome.checkpoint = str(kept.checkpoint)


async def _train_async(
    config: TrainConfig, processes: dict[str, ServerProcess], run_dir: Path, progress: Progress
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
            processes["env"].target,
            processes["policy"].target,
            processes["learner"].target,
            run_dir,
            stop,
            display=progress,
        )
    finally:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            for sig in STOP_SIGNALS:
                loop.remove_signal_handler(sig)
    # No checkpoint asked for here: the learner writes its final one when it is stopped, after
    # the step in flight, and takes no further batch (asking now would let it start one more).
    return outcome


def _finish_outputs(outcome: TrainOutcome, run_dir: Path) -> None:
    records = read_metrics(run_dir / METRICS_FILE)
    if records:
        outcome.plot = str(plot_metrics(records, run_dir / PLOT_FILE, title=run_dir.name))
    outcome.metrics = str(run_dir / METRICS_FILE)
    outcome.rollouts = str(run_dir / "rollouts.jsonl")
    if not outcome.checkpoint:
        from learner.service import latest_learner_checkpoint

        latest = latest_learner_checkpoint(run_dir)
        outcome.checkpoint = str(latest) if latest else ""
    summary = outcome.model_dump(mode="json") | {"tokens_per_s": outcome.tokens_per_s}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def print_summary(outcome: TrainOutcome, console: Console | None = None) -> None:
    table = Table(title=f"sciproto train: {outcome.run_dir}")
    table.add_column("figure")
    table.add_column("value", justify="right")
    steps = outcome.steps
    # One step's batch reward is noisy (a few groups, different tasks): means of up to 5 steps.
    span = max(1, min(5, len(steps) // 2))
    first = f"{statistics.fmean(s.reward_mean for s in steps[:span]):.3f}" if steps else "-"
    last = f"{statistics.fmean(s.reward_mean for s in steps[-span:]):.3f}" if steps else "-"
    refused = ", ".join(f"{k} {v}" for k, v in sorted(outcome.groups_refused.items())) or "none"
    first_step = f"{outcome.first_step_s:.0f} s" if outcome.first_step_s is not None else "-"
    fates = outcome.groups_settled
    settled = (
        f"{fates.get('consumed', 0)} / {fates.get('dropped_stale', 0)} / {outcome.groups_pending}"
    )
    rows = [
        ("optimizer steps", str(steps[-1].step if steps else 0)),
        (f"reward, first -> last {span} step{'s' if span > 1 else ''}", f"{first} -> {last}"),
        ("time", f"{outcome.seconds / 60:.1f} min"),
        ("groups generated / refused", f"{outcome.groups_generated} / {refused}"),
        ("first optimizer step after", first_step),
        ("groups consumed / dropped stale / pending", settled),
        ("generation tokens/s", f"{outcome.tokens_per_s:.0f}"),
        ("generation idle", f"{outcome.generation_idle_s:.1f} s"),
        *([("step groups / forks opened / closed", " / ".join(
            f"{outcome.step_groups[key]:.0f}" for key in ("step_groups", "forks_opened", "forks_closed")))]
          if outcome.step_groups else []),
        ("stopped by", outcome.stopped_by),
        ("checkpoint", outcome.checkpoint or "-"),
        ("metrics", outcome.metrics),
        ("plot", outcome.plot or "-"),
        ("rollouts (sciproto view)", outcome.rollouts),
    ]
    for name, value in rows:
        table.add_row(name, value)
    (console or Console()).print(table)


def main(config: str | None, overrides: list[str]) -> TrainOutcome:
    """`sciproto train`: see the module docstring."""
    try:
        settings = load_train_config(config or "demo", overrides)
        check_envs(settings.env.envs)
    except ConfigError as error:
        raise SystemExit(f"sciproto train: {error}") from None
    outcome = train(settings)
    print_summary(outcome)
    return outcome


__all__ = [
    "TrainConfig",
    "TrainOutcome",
    "group_to_pb",
    "load_train_config",
    "main",
    "run_rollouts_into_learner",
    "train",
]
