"""`sciproto train`: one command that trains end to end on this machine.

    sciproto train --config demo [--set learner.grpo.lr=1e-3 ...]

1. Starts an env server, a policy server and the learner as child processes (logs in the run
   directory), all from the sections of one config file (`env`, `policy`, `learner`).
2. Runs the rollout client here: `collect(...)` over the task split, cycled, streams every finished
   group into the learner's TrainStep stream. Generation goes on while the learner trains (async
   GRPO), but at most `rollout.max_groups_ahead` groups are started and not yet consumed by the
   learner (trained, dropped or refused): with max_staleness 0 and one batch ahead, this is
   synchronous on-policy GRPO.
3. Stops at the budget (optimizer steps and/or seconds) or on Ctrl-C, asks the learner for a final
   checkpoint, stops every child (SIGTERM, then SIGKILL), and prints a summary.

A run directory `runs/<name>` holds: config.yaml (as resolved), env.log / policy.log /
learner.log, checkpoints/, metrics.jsonl, reward.png, rollouts.jsonl (the rollout line format of
`clients.rollouts`; `sciproto view` opens it), rollouts.failures.jsonl and summary.json.
Each pass over the split is an epoch; a group's id is `<env>/<split>/<index>#<epoch>` (its
rollouts' ids add `/<sample>`), so the learner's duplicate check refuses only true retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import signal
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

import grpc
import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from clients import resume
from clients.agent import Sampling, env_pool, policy_pool
from clients.collect import collect, split_size
from clients.retries import Deadlines, RetryPolicy
from clients.rollouts import (
    FINISH_REASON_TO_PB,
    RolloutDetail,
    RolloutGroup,
    RolloutRecord,
    RolloutStatus,
    TaskKey,
)
from env_servers.catalog import check_name
from env_servers.config import EnvServerConfig
from learner.metrics import METRICS_FILE, PLOT_FILE, plot_metrics, read_metrics
from learner.server_config import LearnerServerConfig
from policy_server.config import PolicyServerConfig
from sciproto.channel import make_channel
from sciproto.config import ConfigError, load_config
from sciproto.errors import from_rpc_error
from sciproto.pb import common_pb2, learner_grpc, learner_pb2
from sciproto.processes import ServerProcess, start_server

log = logging.getLogger(__name__)

# Ctrl-C, or a supervisor's polite stop: both end the run cleanly with every output written.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

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
    samples: int = Field(8, ge=2, description="Samples per task: one GRPO group")
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

    @model_validator(mode="after")
    def _learner_trains_the_served_model(self) -> TrainConfig:
        # The learner must build exactly the weights the policy server starts from.
        self.learner.model = self.policy.model
        self.learner.model_seed = self.policy.seed
        env, _ = self.rollout.split()
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
    """The group's id for this pass over the split, and its records renamed to match."""
    group_id = f"{group.group_id}#{epoch}"
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


class TrainOutcome(BaseModel):
    """What a run did; written to summary.json."""

    run_dir: str
    steps: list[StepRecord] = []
    seconds: float = 0.0
    groups_generated: int = 0
    groups_refused: dict[str, int] = {}
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


class _Flow:
    """Counts that gate the rollout client: groups started vs consumed by the learner, and time
    spent with nothing generating."""

    def __init__(self, max_ahead: int) -> None:
        self.max_ahead = max_ahead
        self.started = 0
        self.finished = 0
        self.consumed = 0
        self.changed = asyncio.Condition()
        self.idle_s = 0.0
        self._idle_since: float | None = time.monotonic()

    def _mark(self) -> None:
        now = time.monotonic()
        in_flight = self.started - self.finished
        if in_flight == 0 and self._idle_since is None:
            self._idle_since = now
        elif in_flight > 0 and self._idle_since is not None:
            self.idle_s += now - self._idle_since
            self._idle_since = None

    async def admit(self) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: self.started - self.consumed < self.max_ahead)
            self.started += 1
            self._mark()

    def group_finished(self) -> None:
        self.finished += 1
        self._mark()

    async def consume(self, count: int) -> None:
        async with self.changed:
            self.consumed += count
            self.changed.notify_all()

    def total_idle_s(self) -> float:
        return self.idle_s + (
            time.monotonic() - self._idle_since if self._idle_since is not None else 0.0
        )


async def run_rollouts_into_learner(
    config: TrainConfig,
    env_target: str,
    policy_target: str,
    learner_target: str,
    run_dir: Path,
    stop: asyncio.Event,
    on_step: Callable[[StepRecord, TrainOutcome], None] = lambda *_: None,
) -> TrainOutcome:
    """Stream rollout groups into the learner until the budget is spent or `stop` is set."""
    rollout = config.rollout
    env_name, split = rollout.split()
    flow = _Flow(config.max_groups_ahead)
    outcome = TrainOutcome(run_dir=str(run_dir))
    outgoing: asyncio.Queue[learner_pb2.TrainStepRequest] = asyncio.Queue()
    started = time.monotonic()

    async with env_pool([env_target]) as env, policy_pool([policy_target]) as policy:
        size = await split_size(env, env_name, split, rollout.deadlines.describe_s)
        # A resumed run continues after the groups its learner trained, never re-sending one.
        point = resume.resume_point(resume.trained_group_ids(run_dir), env_name, split, size)
        epochs: dict[TaskKey, int] = point.epochs
        if point.trained:
            log.info("resuming after %d trained groups of %s:%s", point.trained, env_name, split)

        async def tasks() -> AsyncIterator[TaskKey]:
            for number in itertools.count(point.start):
                await flow.admit()
                # Epochs over a bounded split; an unbounded one (any index is a task) never repeats.
                yield TaskKey(env_name, split, number if size is None else number % size)

        async def produce(rollouts_file: IO[str], failures_file: IO[str]) -> None:
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
            ):
                flow.group_finished()
                epoch = epochs.get(group.task, 0)
                epochs[group.task] = epoch + 1
                group_id, records = with_epoch(group, epoch)
                for record in records:
                    sink = (
                        failures_file
                        if record.status is RolloutStatus.INFRA_ERROR
                        else rollouts_file
                    )
                    sink.write(record.to_json_line(rollout.rollouts_file))
                rollouts_file.flush()
                failures_file.flush()
                outcome.groups_generated += 1
                outcome.completion_tokens += sum(r.tokens.completion for r in records)
                outgoing.put_nowait(
                    learner_pb2.TrainStepRequest(group=group_to_pb(group_id, records))
                )

        async def requests() -> AsyncIterator[learner_pb2.TrainStepRequest]:
            while True:
                yield await outgoing.get()

        async def consume(call: Any) -> None:
            async for event in call:
                kind = event.WhichOneof("event")
                if kind == "receipt":
                    if not event.receipt.accepted:
                        reason = event.receipt.reason
                        outcome.groups_refused[reason] = outcome.groups_refused.get(reason, 0) + 1
                        if reason == "invalid":
                            log.warning(
                                "learner refused group %s: %s",
                                event.receipt.group_id,
                                event.receipt.detail,
                            )
                        await flow.consume(1)
                elif kind == "step":
                    result = event.step
                    metrics = result.metrics
                    await flow.consume(result.groups + int(metrics.get("groups_dropped_stale", 0)))
                    record = StepRecord(
                        step=result.step,
                        policy_version=result.policy_version,
                        reward_mean=metrics.get("reward_mean", math.nan),
                        policy_lag_mean=metrics.get("policy_lag_mean", 0.0),
                        groups=result.groups,
                        seconds=time.monotonic() - started,
                    )
                    outcome.steps.append(record)
                    on_step(record, outcome)
                    if reason := budget_spent(config.budget, outcome.steps):
                        outcome.stopped_by = outcome.stopped_by or reason
                        stop.set()
                else:
                    log.warning("learner reported: %s", event.error.message)

        async def deadline(seconds: float) -> None:
            await asyncio.sleep(seconds)
            outcome.stopped_by = outcome.stopped_by or "max_seconds"
            stop.set()

        channel = make_channel(learner_target)
        with (
            (run_dir / "rollouts.jsonl").open("a", encoding="utf-8") as rollouts_file,
            (run_dir / "rollouts.failures.jsonl").open("w", encoding="utf-8") as failures_file,
        ):
            call = learner_grpc.LearnerServiceStub(channel).TrainStep(requests())
            workers = [
                asyncio.create_task(produce(rollouts_file, failures_file), name="rollouts"),
                asyncio.create_task(consume(call), name="learner stream"),
            ]
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
                call.cancel()
                for task in [*workers, stopper]:
                    task.cancel()
                await asyncio.gather(*workers, stopper, return_exceptions=True)
                outcome.seconds = time.monotonic() - started
                outcome.generation_idle_s = flow.total_idle_s()
                await channel.close()
    return outcome


async def final_checkpoint(
    learner_target: str, timeout_s: float
) -> learner_pb2.SaveCheckpointResponse:
    async with make_channel(learner_target) as channel:
        try:
            return await learner_grpc.LearnerServiceStub(channel).SaveCheckpoint(
                learner_pb2.SaveCheckpointRequest(), timeout=timeout_s
            )
        except grpc.RpcError as error:
            raise from_rpc_error(error) from error


# ---------------------------------------------------------------------- processes


def write_component_config(config: TrainConfig, run_dir: Path, policy_target: str) -> Path:
    """The resolved config every child reads its own section of."""
    learner = config.learner.model_copy(
        update={
            "policy_targets": [policy_target],
            "run_dir": run_dir,
            "max_steps": config.budget.max_steps,
        }
    )
    resolved = config.model_copy(update={"learner": learner})
    path = run_dir / "config.yaml"
    path.write_text(yaml.safe_dump(resolved.model_dump(mode="json"), sort_keys=False))
    return path


def _threads_env(threads: int) -> dict[str, str] | None:
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)} if threads else None


def start_servers(config: TrainConfig, run_dir: Path) -> dict[str, ServerProcess]:
    """Env and policy servers (side by side), then the learner once the policy's port is known."""
    processes: dict[str, ServerProcess] = {}
    timeout_s = config.processes.start_timeout_s
    base_path = run_dir / "config.yaml"
    base_path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            futures = {
                "env": pool.submit(
                    start_server,
                    ["serve", "env", "--config", str(base_path), "--port", "0"],
                    timeout_s=timeout_s,
                    log_file=run_dir / "env.log",
                ),
                "policy": pool.submit(
                    start_server,
                    ["serve", "policy", "--config", str(base_path), "--port", "0"],
                    timeout_s=timeout_s,
                    log_file=run_dir / "policy.log",
                    env=_threads_env(config.processes.policy_threads),
                ),
            }
            failures = []
            for name, future in futures.items():
                try:
                    processes[name] = future.result()
                except Exception as error:  # noqa: BLE001 - every failure is reported together below
                    failures.append(f"{name}: {getattr(error, 'headline', error)}")
            if failures:
                raise RuntimeError("could not start the servers:\n" + "\n".join(failures))
        path = write_component_config(config, run_dir, processes["policy"].target)
        processes["learner"] = start_server(
            ["serve", "learner", "--config", str(path), "--port", "0"],
            timeout_s=timeout_s,
            log_file=run_dir / "learner.log",
            env=_threads_env(config.processes.learner_threads),
        )
    except BaseException:
        stop_servers(processes, config.processes.stop_timeout_s)
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


# ---------------------------------------------------------------------- the command


class _Progress:
    """A live line: step, reward, policy lag, generation throughput."""

    def __init__(self, total: int | None, enabled: bool) -> None:
        self.bar = tqdm(
            total=total, unit="step", disable=not enabled, dynamic_ncols=True, desc="train"
        )

    def update(self, record: StepRecord, tokens_per_s: float) -> None:
        self.bar.update(record.step - self.bar.n)
        self.bar.set_postfix(
            reward=f"{record.reward_mean:.3f}",
            lag=f"{record.policy_lag_mean:.2f}",
            version=record.policy_version,
            tok_s=f"{tokens_per_s:.0f}",
        )

    def close(self) -> None:
        self.bar.close()


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
    progress = _Progress(config.budget.max_steps, config.progress)
    try:
        outcome = asyncio.run(_train_async(config, processes, run_dir, progress))
    finally:
        progress.close()
        stop_servers(processes, config.processes.stop_timeout_s)
        _finish_outputs(outcome, run_dir)
    return outcome


async def _train_async(
    config: TrainConfig, processes: dict[str, ServerProcess], run_dir: Path, progress: _Progress
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
    started = time.monotonic()

    def on_step(record: StepRecord, outcome: TrainOutcome) -> None:
        progress.update(record, outcome.completion_tokens / max(time.monotonic() - started, 1e-9))

    try:
        outcome = await run_rollouts_into_learner(
            config,
            processes["env"].target,
            processes["policy"].target,
            processes["learner"].target,
            run_dir,
            stop,
            on_step,
        )
    finally:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            for sig in STOP_SIGNALS:
                loop.remove_signal_handler(sig)
    # A run that made no optimizer step has nothing new to save (a checkpoint now would be a
    # copy of the base model, or of the checkpoint it resumed from).
    if outcome.steps and processes["learner"].alive():
        saved = await final_checkpoint(processes["learner"].target, config.processes.stop_timeout_s)
        outcome.checkpoint = saved.directory
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
    first = f"{steps[0].reward_mean:.3f}" if steps else "-"
    last = f"{steps[-1].reward_mean:.3f}" if steps else "-"
    refused = ", ".join(f"{k} {v}" for k, v in sorted(outcome.groups_refused.items())) or "none"
    rows = [
        ("optimizer steps", str(steps[-1].step if steps else 0)),
        ("reward first -> last step", f"{first} -> {last}"),
        ("time", f"{outcome.seconds / 60:.1f} min"),
        ("groups generated / refused", f"{outcome.groups_generated} / {refused}"),
        ("generation tokens/s", f"{outcome.tokens_per_s:.0f}"),
        ("generation idle", f"{outcome.generation_idle_s:.1f} s"),
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
