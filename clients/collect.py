"""Collect rollouts: the streaming Python API and `sciproto collect`.

    async with env_pool(["127.0.0.1:50051"]) as env, policy_pool(["127.0.0.1:50052"]) as policy:
        async for group in collect(tasks_of("gsm8k", "test", 100), env=env, policy=policy,
                                   samples=4, concurrency=64):
            ...                                 # each group as soon as its samples are done

`collect` pulls tasks from the (async) iterable only when a group can start, so memory stays
flat however many tasks are queued; at most `concurrency // samples` groups (at least one) run
at once. Groups come out in the order they finish.

Servers that require a bearer token (`sciproto serve ... --auth FILE`) are reached with the token
named in `env_access` / `policy_access` (a file or an environment variable, never the token
itself), e.g. `--set policy_access.token_env=POLICY_TOKEN`.

`sciproto collect` writes one line per rollout (format: `sciproto.client.rollouts`) to the output file,
appended and flushed as each group finishes; INFRA_ERROR rollouts go to
`<stem>.failures.jsonl` (rewritten every run, so a rerun tries those tasks again); a rerun skips
rollout ids already in the output and cuts a torn last line left by a crash. At the end it prints
a summary table and writes it to `<stem>.summary.json`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from pathlib import Path
from typing import IO, Literal, TypeVar

import grpc
from pydantic import BaseModel, ConfigDict, Field
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from clients.agent import (
    AgentSettings,
    EnvPool,
    PolicyPool,
    ResetOptions,
    env_pool,
    policy_pool,
    run_group,
)
from clients.step_groups import StepGrouping
from clients.step_rollouts import StepGroupSettings, StepTask, run_step_task
from clients.summary import CollectSummary, summarize
from sciproto.channel import ServerAccess
from sciproto.client.retries import Deadlines, RetryPolicy
from sciproto.client.rollouts import (
    RolloutDetail,
    RolloutGroup,
    RolloutRecord,
    RolloutStatus,
    TaskKey,
    drop_torn_tail,
    read_rollouts,
)
from sciproto.config import load_config
from sciproto.errors import Reason, SciprotoError
from sciproto.sampling import EpisodeSettings, Sampling
from sciproto.tracing import TracingConfig, client_interceptors, setup_tracing, shutdown_tracing

log = logging.getLogger(__name__)

T = TypeVar("T")


class ReplicaSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    probe_interval_s: float = Field(0.5, gt=0, description="First wait between health probes of a failed replica")
    probe_max_interval_s: float = Field(5.0, gt=0, description="Longest wait between probes (the wait doubles)")
    wait_for_healthy_s: float = Field(30.0, gt=0, description="How long a call waits for some replica to be healthy")


class CollectConfig(EpisodeSettings):
    """Settings of `sciproto collect` (addresses, tasks and counts come from the command line): how
    each episode is played (sciproto.sampling.EpisodeSettings), and the run around them."""

    model_config = ConfigDict(extra="forbid")

    grouping: Literal["trajectory", "step"] = Field(
        "trajectory", description="step: each line is a branch of a step group (clients.step_rollouts); "
                                  "--samples is then unused, step_groups.group_size is the group")
    step_groups: StepGroupSettings = Field(default_factory=StepGroupSettings)
    observation: Literal["history", "state"] | None = Field(
        None, description="The notebook env's context policy, sent with every Reset (unset: the env's default)")
    reset_options: ResetOptions = Field(
        default_factory=dict, description="More per-episode env options sent with every Reset (notebook: action: code)")
    replicas: ReplicaSettings = Field(default_factory=ReplicaSettings)
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    env_access: ServerAccess = Field(default_factory=ServerAccess, description="Token and TLS of the env servers")
    policy_access: ServerAccess = Field(default_factory=ServerAccess, description="Token and TLS of the policy servers")
    success_reward: float = Field(1.0, description="A rollout passes (for pass@k) when its reward is at least this")
    progress: bool = Field(True, description="Show a progress bar")
    rollouts: RolloutDetail = Field("full", description=(
        "full: every token id, mask bit and logprob (what training needs); summary: the same lines"
        " without those arrays, a fraction of the size (see sciproto.client.rollouts)"))

    def agent_settings(self) -> AgentSettings:
        return AgentSettings(self.sampling, self.max_steps, self.max_tokens, self.retries, self.deadlines,
                             self.options)

    @property
    def options(self) -> dict[str, str]:
        """The env options of every Reset."""
        return {**self.reset_options, **({"observation": self.observation} if self.observation else {})}


def tasks_of(env: str, split: str, count: int, start: int = 0) -> Iterator[TaskKey]:
    """Tasks `start` .. `start + count - 1` of a split, generated lazily."""
    return (TaskKey(env, split, index) for index in range(start, start + count))


async def _iterate(tasks: Iterable[TaskKey] | AsyncIterable[TaskKey]) -> AsyncIterator[TaskKey]:
    if isinstance(tasks, AsyncIterable):
        async for task in tasks:
            yield task
    else:
        for task in tasks:
            yield task


async def stream_runs(tasks: Iterable[TaskKey] | AsyncIterable[TaskKey], max_running: int,
                  run: Callable[[TaskKey], Awaitable[T]]) -> AsyncIterator[T]:
    """`run(task)` for every task, at most `max_running` at once, each result as it completes. The
    iterator is asked for a task only while a slot is free; leaving the loop early (or cancelling)
    cancels the runs in flight."""
    upcoming: AsyncIterator[TaskKey] | None = _iterate(tasks)
    running: set[asyncio.Task[T]] = set()
    next_task: asyncio.Task[TaskKey] | None = None
    try:
        while True:
            # Admission: ask the iterator for one more task only while a slot is free.
            if next_task is None and upcoming is not None and len(running) < max_running:
                next_task = asyncio.ensure_future(anext(upcoming))
            waiting = running | ({next_task} if next_task else set())
            if not waiting:
                return
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if next_task in done:
                try:
                    task = next_task.result()
                except StopAsyncIteration:
                    upcoming = None
                else:
                    running.add(asyncio.create_task(run(task), name=f"group {task.group_id}"))
                next_task = None
            for finished in done & running:
                running.discard(finished)
                yield finished.result()
    finally:
        leftovers = [*running, *([next_task] if next_task else [])]
        for leftover in leftovers:
            leftover.cancel()
        await asyncio.gather(*leftovers, return_exceptions=True)


async def collect(
    tasks: Iterable[TaskKey] | AsyncIterable[TaskKey],
    *,
    env: EnvPool,
    policy: PolicyPool,
    samples: int = 1,
    concurrency: int = 16,
    sampling: Sampling | None = None,
    max_steps: int = 8,
    max_tokens: int = 4096,
    retries: RetryPolicy | None = None,
    deadlines: Deadlines | None = None,
    options: Mapping[str, str] | None = None,
    adapter: str = "",
) -> AsyncIterator[RolloutGroup]:
    """Run every task's group of `samples` episodes, at most `concurrency` episodes at once,
    and yield each group as it completes. Leaving the loop early (or cancelling) cancels the
    groups in flight; their episodes are closed on the way out. `options` go to every Reset
    (the environment's per-episode options, e.g. the notebook's {"observation": "state"}); `adapter`
    names the policy server's LoRA adapter to sample with."""
    if samples < 1 or concurrency < 1:
        raise ValueError(f"samples ({samples}) and concurrency ({concurrency}) must be >= 1")
    settings = AgentSettings(sampling or Sampling(), max_steps, max_tokens, retries or RetryPolicy(),
                             deadlines or Deadlines(), dict(options or {}), adapter)
    # aclosing: when the caller leaves early, the runs in flight are cancelled and their episodes
    # closed before this generator's aclose() returns, not later when the inner one is collected.
    async with contextlib.aclosing(stream_runs(tasks, max(1, concurrency // samples),
                                           lambda task: run_group(task, samples, env, policy, settings))) as groups:
        async for group in groups:
            yield group


async def collect_step_tasks(
    tasks: Iterable[TaskKey] | AsyncIterable[TaskKey],
    *,
    env: EnvPool,
    policy: PolicyPool,
    grouping: StepGrouping,
    settings: AgentSettings,
    concurrency: int = 16,
) -> AsyncIterator[StepTask]:
    """Play every task with step-level groups (clients.step_rollouts), about `concurrency`
    episodes at once (a task holds up to `grouping.group_size` forks), and yield each task's step
    groups as soon as the task is done."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    async with contextlib.aclosing(stream_runs(
            tasks, max(1, concurrency // grouping.group_size),
            lambda task: run_step_task(task, env, policy, settings, grouping, settings.options))) as done:
        async for task in done:
            yield task


# -------------------------------------------------------------------- the command


class CollectError(ValueError):
    """Bad `sciproto collect` input; the message says what to fix."""


class NothingSucceeded(RuntimeError):
    """Every rollout of a `sciproto collect` run failed: the command exits non-zero."""


def parse_tasks(spec: str) -> tuple[str, str]:
    env, sep, split = spec.partition(":")
    if not sep or not env or not split or ":" in split:
        raise CollectError(f"--tasks {spec!r} must look like ENV:SPLIT, e.g. gsm8k:test")
    return env, split


def output_paths(output: Path) -> tuple[Path, Path]:
    """(failures file, summary file) beside `output`."""
    return output.with_name(f"{output.stem}.failures.jsonl"), output.with_name(f"{output.stem}.summary.json")


async def check_reachable(pool: EnvPool | PolicyPool, what: str, timeout_s: float) -> None:
    """Fail at once, saying so, when a server of the pool does not answer Describe (instead of
    failing every rollout after the pool's wait for a healthy replica)."""
    for replica in pool.replicas:
        try:
            await replica.client.describe(timeout_s)
        except SciprotoError as error:
            if error.code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                raise  # it answers, and its message says which token to send
            if error.reason == Reason.INCOMPATIBLE_PROTOCOL:
                raise CollectError(error.message) from error  # it answers, in another major version
            if error.code == grpc.StatusCode.UNIMPLEMENTED:
                raise CollectError(f"{replica.target} is not a {what} server (it has no {pool.service});"
                                   f" give the {what} server's address") from error
            raise CollectError(f"{what} server {replica.target} does not answer ({error.code.name}:"
                               f" {error.message}); is it running, at that address?") from error


async def split_size(env: EnvPool, name: str, split: str, timeout_s: float) -> int | None:
    """Number of tasks in the split; None when it is unbounded."""
    async with env.lease() as replica:
        described = await replica.client.describe(timeout=timeout_s)
    for info in described.environments:
        if info.name == name:
            for split_info in info.splits:
                if split_info.name == split:
                    return None if split_info.unbounded else split_info.size
            raise CollectError(f"environment {name!r} has no split {split!r}; its splits are"
                               f" {[s.name for s in info.splits]}")
    raise CollectError(f"env server {replica.target} does not host {name!r}; it hosts"
                       f" {[e.name for e in described.environments]}")


async def fork_mode(env: EnvPool, name: str, timeout_s: float) -> int:
    """How environment `name` forks an episode (EnvironmentInfo.fork, a ForkMode)."""
    async with env.lease() as replica:
        described = await replica.client.describe(timeout=timeout_s)
    for info in described.environments:
        if info.name == name:
            return info.fork
    raise CollectError(f"env server {replica.target} does not host {name!r}")


class RolloutWriter:
    """Appends finished rollouts: judged ones to the output, INFRA_ERROR ones to the failures
    file; skips ids the output already holds."""

    def __init__(self, output: Path, failures: Path, detail: RolloutDetail = "full") -> None:
        output.parent.mkdir(parents=True, exist_ok=True)
        self.detail = detail
        drop_torn_tail(output)
        self.done = {record.rollout_id for record in read_rollouts(output)}
        self._output: IO[str] = output.open("a", encoding="utf-8")
        self._failures: IO[str] = failures.open("w", encoding="utf-8")
        self.written = self.failed = 0

    def write(self, group: RolloutGroup) -> list[RolloutRecord]:
        """The rollouts of `group` that were new, after writing them."""
        new = [r for r in group.rollouts if r.rollout_id not in self.done]
        for record in new:
            sink = self._failures if record.status is RolloutStatus.INFRA_ERROR else self._output
            sink.write(record.to_json_line(self.detail))
            if record.status is RolloutStatus.INFRA_ERROR:
                self.failed += 1
            else:
                self.done.add(record.rollout_id)
                self.written += 1
        self._output.flush()
        self._failures.flush()
        return new

    def close(self) -> None:
        self._output.close()
        self._failures.close()


def tasks_to_run(size: int | None, limit: int | None, split: str) -> int:
    """The first `limit` tasks of the split, or all of them; an unbounded split needs a limit."""
    if size is None:
        if limit is None:
            raise CollectError(f"split {split} is unbounded (any index is a task): pass --limit N")
        return limit
    return size if limit is None else min(limit, size)


def pending_tasks(env_name: str, split: str, count: int, samples: int, done: set[str]) -> list[TaskKey]:
    """Tasks with at least one sample missing from the output (the whole group runs again; only
    the missing samples are written)."""
    tasks = tasks_of(env_name, split, count)
    return [t for t in tasks if any(t.rollout_id(s) not in done for s in range(samples))]


def pending_step_tasks(env_name: str, split: str, count: int, done: set[str]) -> list[TaskKey]:
    """grouping step: tasks no step group of which is in the output yet (rollout ids
    `<env>/<split>/<index>/step<k>/<sample>`)."""
    started = {rollout_id.rsplit("/step", 1)[0] for rollout_id in done if "/step" in rollout_id}
    return [t for t in tasks_of(env_name, split, count) if t.group_id not in started]


async def run_collection(env_targets: Sequence[str], policy_targets: Sequence[str], tasks: str, output: Path,
                         limit: int | None, samples: int, concurrency: int, config: CollectConfig) -> CollectSummary:
    env_name, split = parse_tasks(tasks)
    failures_path, summary_path = output_paths(output)
    interceptors = client_interceptors(config.tracing)
    options = config.replicas.model_dump()
    started = time.monotonic()
    env_channels = [config.env_access.channel(target) for target in env_targets]
    policy_channels = [config.policy_access.channel(target) for target in policy_targets]
    async with env_pool(env_channels, interceptors=interceptors, **options) as env, \
            policy_pool(policy_channels, interceptors=interceptors, **options) as policy:
        await check_reachable(env, "env", config.deadlines.describe_s)
        size = await split_size(env, env_name, split, config.deadlines.describe_s)
        await check_reachable(policy, "policy", config.deadlines.describe_s)
        count = tasks_to_run(size, limit, f"{env_name}:{split}")
        writer = RolloutWriter(output, failures_path, config.rollouts)
        stepwise = config.grouping == "step"
        todo = (pending_step_tasks(env_name, split, count, writer.done) if stepwise
                else pending_tasks(env_name, split, count, samples, writer.done))
        log.info("%d of %d tasks to run (%s); %d rollouts already in %s", len(todo), count,
                 "step groups" if stepwise else f"{samples} samples each", len(writer.done), output)
        rewards: list[float] = []
        bar = tqdm(total=len(todo) * (1 if stepwise else samples), unit="task" if stepwise else "rollout",
                   disable=not config.progress, dynamic_ncols=True)

        def wrote(group: RolloutGroup) -> None:
            writer.write(group)
            nonlocal rewards
            rewards += [r.reward for r in group.rollouts if r.status is RolloutStatus.SCORED]
            bar.set_postfix(mean_reward=f"{sum(rewards) / len(rewards):.3f}" if rewards else "-",
                            errors=writer.failed)

        try:
            if stepwise:
                async for played in collect_step_tasks(todo, env=env, policy=policy,
                                                       grouping=config.step_groups.grouping(),
                                                       settings=config.agent_settings(), concurrency=concurrency):
                    for group in played.groups:
                        wrote(group)
                    bar.update(1)
            else:
                async for group in collect(todo, env=env, policy=policy, samples=samples, concurrency=concurrency,
                                           sampling=config.sampling, max_steps=config.max_steps,
                                           max_tokens=config.max_tokens, retries=config.retries,
                                           deadlines=config.deadlines, options=config.options):
                    wrote(group)
                    bar.update(len(group.rollouts))
        finally:
            bar.close()
            writer.close()
    summary = summarize(read_rollouts(output), writer.failed, success_reward=config.success_reward,
                        seconds=time.monotonic() - started, finished_this_run=writer.written + writer.failed,
                        judged_this_run=writer.written)
    summary_path.write_text(summary.model_dump_json(indent=2) + "\n")
    return summary


def print_summary(summary: CollectSummary, output: Path, console: Console | None = None) -> None:
    table = Table(title=f"sciproto collect: {output}")
    table.add_column("figure")
    table.add_column("value", justify="right")
    mean = "-" if summary.mean_reward is None else f"{summary.mean_reward:.4f}"
    rows = [("rollouts", str(summary.rollouts)), ("groups", str(summary.groups)),
            ("scored / unscored", f"{summary.scored} / {summary.unscored}"),
            ("infra errors (this run)", str(summary.infra_errors)), ("mean reward (scored)", mean),
            *((name, f"{value:.4f}") for name, value in summary.pass_at_k.items()),
            ("prompt / completion tokens", f"{summary.tokens['prompt']} / {summary.tokens['completion']}"),
            ("rollouts/s (this run)", f"{summary.rollouts_per_s:.2f}")]
    for name, value in rows:
        table.add_row(name, value)
    (console or Console()).print(table)


def main(*, env: list[str], policy: list[str], tasks: str, output: Path, limit: int | None = None,
         samples: int = 1, concurrency: int = 16, config: str | None = None,
         overrides: Sequence[str] = ()) -> CollectSummary:
    """`sciproto collect`: see the module docstring."""
    if samples < 1 or concurrency < 1:
        raise CollectError(f"--samples ({samples}) and --concurrency ({concurrency}) must be at least 1")
    if limit is not None and limit < 0:
        raise CollectError(f"--limit must be >= 0, got {limit}")
    settings = load_config(CollectConfig, config, list(overrides))
    setup_tracing(settings.tracing, "sciproto-rollout")
    try:
        summary = asyncio.run(run_collection(env, policy, tasks, Path(output), limit, samples, concurrency, settings))
    finally:
        shutdown_tracing()
    print_summary(summary, Path(output))
    if summary.infra_errors and not summary.judged_this_run:
        raise NothingSucceeded(f"no rollout succeeded: all {summary.infra_errors} failed (infra errors);"
                               f" their errors are in {output_paths(Path(output))[0]}")
    return summary


__all__ = ["CollectConfig", "CollectError", "NothingSucceeded", "ReplicaSettings", "collect", "collect_step_tasks", "main", "run_collection", "tasks_of"]
