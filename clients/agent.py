"""The agent loop: one task, `samples` episodes (a GRPO group), each

    Reset -> Generate -> Step -> Generate -> Step ... -> Verify -> Close (always)

until the environment terminates or truncates the episode, or the step or token budget runs out.

Every sample has its own environment episode, pinned to the env replica that reset it. The
first turn of the group is one Generate with `n` = the samples whose Reset gave the same prompt
(`SharedFirstTurn`); after that each sample continues alone, sending the previous turn's exact
prompt + completion ids (`previous_token_ids`) with the whole transcript, so its tokens extend
token for token (checked by `Trajectory.add_turn`).

Failures: calls are retried within bounds (`sciproto.client.retries`); an episode whose env replica died
or stayed too slow starts again from Reset on another replica, at most `retries.episode_restarts`
times; anything else the environment or the policy could not do ends the episode as an
INFRA_ERROR rollout carrying the error text. Only a task the environment refuses (unknown
environment, split or index) and authentication failures raise: no retry can cure them.

Tracing (no-op unless `sciproto.tracing.setup_tracing` installed an exporter): one trace per
episode, `invoke_agent {env}`, with children `sciproto.env.reset`, `chat` (each Generate),
`sciproto.env.step` (each), `sciproto.env.verify` and `sciproto.env.close`. The shared first
Generate is sent once, under the first waiting sample's `chat` span; the other samples' `chat`
spans cover their wait for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, TypeVar

from pydantic import BeforeValidator

from sciproto import pb
from sciproto.channel import ChannelConfig
from sciproto.client.env import EnvClient
from sciproto.client.policy import GenerationGroup, PolicyClient, generate_request, text_only
from sciproto.client.replicas import Replica, ReplicaPool
from sciproto.client.retries import Deadlines, RetryPolicy, call_with_deadline, with_retries
from sciproto.client.rollouts import (
    FinishReasonName,
    MessageRecord,
    RolloutGroup,
    RolloutRecord,
    RolloutStatus,
    TaskKey,
    TokenDriftError,
    Trajectory,
    finish_reason_name,
    status_from_pb,
)
from sciproto.errors import (
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Reason,
    ResourceExhausted,
    SciprotoError,
    Unauthenticated,
    Unavailable,
)
from sciproto.pb import common_pb2, env_pb2, policy_pb2
from sciproto.sampling import UNTRANSFORMED, Distribution, Sampling
from sciproto.tracing import (
    Attr,
    Operation,
    current_trace_context,
    current_trace_id,
    span_name,
    start_span,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

EnvPool = ReplicaPool[EnvClient]
PolicyPool = ReplicaPool[PolicyClient]

# Errors no retry or restart can cure (shared with the step-group runner): a task whose name the
# server refuses is rejected (TaskRejected); an auth refusal stops the collection and says what to fix.
TASK_REASONS = {Reason.UNKNOWN_ENVIRONMENT, Reason.UNKNOWN_SPLIT, Reason.TASK_OUT_OF_RANGE}
FATAL_ERRORS = (Unauthenticated, PermissionDenied)


def env_pool(targets: Sequence[str | ChannelConfig], **options: object) -> EnvPool:
    """A pool of env server replicas; options as for ReplicaPool. Its channels leave the shared
    Session stream uncovered by the default interceptors when there is no token (bare_streams)."""
    options.setdefault("bare_streams", True)
    return ReplicaPool(targets, EnvClient, pb.ENV_SERVICE, **options)  # type: ignore[arg-type]


def policy_pool(targets: Sequence[str | ChannelConfig], **options: object) -> PolicyPool:
    """A pool of policy server replicas; options as for ReplicaPool."""
    return ReplicaPool(targets, PolicyClient, pb.POLICY_SERVICE, **options)  # type: ignore[arg-type]


def _option_text(value: object) -> object:
    """A per-episode env option as it goes on the wire: YAML scalars (0.1, true) as their text."""
    if isinstance(value, bool):
        return str(value).lower()
    return str(value) if isinstance(value, int | float) else value


# Per-episode env options (ResetRequest.options) as a config gives them.
ResetOptions = dict[str, Annotated[str, BeforeValidator(_option_text)]]


@dataclass(frozen=True)
class AgentSettings:
    sampling: Sampling
    max_steps: int  # most Steps per episode
    max_tokens: int  # most tokens in a whole trajectory (prompt, environment and policy tokens)
    retries: RetryPolicy
    deadlines: Deadlines
    # The environment's per-episode options, sent with every Reset (notebook: {"observation":
    # "history" | "state"}).
    options: Mapping[str, str] = field(default_factory=dict)
    # The policy server's LoRA adapter every Generate samples with ("": the base weights).
    adapter: str = ""

    def __post_init__(self) -> None:
        if self.max_steps < 1 or self.max_tokens < 1:
            raise ValueError(f"max_steps ({self.max_steps}) and max_tokens ({self.max_tokens}) must be >= 1")


class TaskRejected(ValueError):
    """The environment refuses the task itself (unknown environment, split or index)."""


class EpisodeFailed(Exception):
    """The episode cannot finish; `restartable` when a fresh Reset elsewhere may succeed."""

    def __init__(self, message: str, *, restartable: bool) -> None:
        super().__init__(message)
        self.restartable = restartable


@dataclass(frozen=True)
class Completion:
    """One sampled turn: the prompt ids as the policy saw them and the sample."""

    prompt_token_ids: list[int]
    sample: policy_pb2.GenerateSample
    sampling: Distribution = UNTRANSFORMED  # what the sample was drawn from


async def finish_despite_cancellation(operation: Awaitable[T]) -> T:
    """Run `operation` to its end even if the caller is cancelled meanwhile, then pass the
    cancellation on. For the clean-up of an episode being cancelled (Close): a second
    cancellation (a task group aborting its other tasks after one failed) would otherwise drop
    the Close mid-flight and leave the episode open on the server until its idle TTL. Bounded:
    `operation` carries its own deadline."""
    task = asyncio.ensure_future(operation)
    cancelled = False
    while not task.done():
        try:
            await asyncio.wait({task})  # unlike awaiting the task, a cancelled wait leaves it running
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        if not task.cancelled():
            task.exception()  # its outcome no longer matters; mark it seen
        raise asyncio.CancelledError
    return task.result()


async def generate(policy: PolicyPool, settings: AgentSettings, messages: Sequence[common_pb2.ChatMessage],
                   tools: Sequence[common_pb2.ToolSpec], *, previous_token_ids: Sequence[int] = (),
                   n: int = 1, max_tokens: int) -> GenerationGroup:
    """One Generate of `n` samples on the least-loaded policy replica; a try that fails is sent
    again (to another replica when one is marked down), within `settings.retries`."""
    sampling = settings.sampling
    request = generate_request(
        # The policy models served here take text: image parts stay in the transcript (and the
        # rollout record) and the policy sees the message's text.
        messages=[text_only(message) for message in messages], tools=tools, previous_token_ids=previous_token_ids, n=n,
        temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, max_tokens=max_tokens,
        stop=sampling.stop, seed=sampling.seed, request_id=uuid.uuid4().hex, adapter=settings.adapter)
    request.trace_context.CopyFrom(current_trace_context())

    async def once(timeout_s: float) -> GenerationGroup:
        async with policy.lease() as replica:
            try:
                group = await replica.client.generate_group(request, timeout_s=timeout_s)
            except Unavailable as error:
                policy.mark_down(replica, error)
                raise
        if len(group.samples) != n:
            raise Unavailable(f"policy {replica.target} returned {len(group.samples)} of {n} samples")
        if any(s.finish_reason == policy_pb2.FINISH_REASON_ABORT for s in group.samples):
            raise Unavailable(f"policy {replica.target} aborted the generation")
        return group

    return await with_retries(once, settings.retries, settings.deadlines.generate_s, "Generate")


class SharedFirstTurn:
    """The first Generate of a group: one call with `n` for the samples whose Reset gave the same
    prompt. It is sent once every sample has either asked for its turn or left (its Reset failed);
    each call runs in the context of its first waiter, so it belongs to that episode's trace."""

    def __init__(self, samples: int, call: Callable[[Sequence[common_pb2.ChatMessage], Sequence[common_pb2.ToolSpec], int],
                                                   Awaitable[GenerationGroup]]) -> None:
        self._call = call
        self._undecided = set(range(samples))
        self._waiting: dict[bytes, list[tuple[int, asyncio.Future[Completion]]]] = {}
        self._prompts: dict[bytes, tuple[list[common_pb2.ChatMessage], list[common_pb2.ToolSpec], contextvars.Context]] = {}
        self._calls: list[asyncio.Task[None]] = []

    async def take(self, sample: int, messages: list[common_pb2.ChatMessage],
                   tools: list[common_pb2.ToolSpec]) -> Completion:
        key = b"".join(m.SerializeToString(deterministic=True) + b"\x00" for m in [*messages, *tools])
        future: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(key, []).append((sample, future))
        self._prompts.setdefault(key, (messages, tools, contextvars.copy_context()))
        self._decided(sample)
        return await future

    def leave(self, sample: int) -> None:
        """`sample` will not take a turn here (no-op if it already did)."""
        if sample in self._undecided:
            self._decided(sample)

    def _decided(self, sample: int) -> None:
        self._undecided.discard(sample)
        if self._undecided:
            return
        for key, waiters in self._waiting.items():
            messages, tools, context = self._prompts[key]
            self._calls.append(asyncio.get_running_loop().create_task(
                self._generate(messages, tools, waiters), context=context))

    async def _generate(self, messages: list[common_pb2.ChatMessage], tools: list[common_pb2.ToolSpec],
                        waiters: list[tuple[int, asyncio.Future[Completion]]]) -> None:
        try:
            group = await self._call(messages, tools, len(waiters))
        except Exception as error:  # noqa: BLE001 - handed to every waiter, which records or raises it
            for _, future in waiters:
                if not future.done():
                    future.set_exception(error)
            return
        except asyncio.CancelledError:
            # Cancelled from outside (a replica's channel closed under the call): every waiter
            # must still hear of it, or its episode waits for ever.
            for _, future in waiters:
                if not future.done():
                    future.set_exception(Unavailable(
                        "the first-turn Generate was cancelled (its policy server went away)",
                        Reason.SHUTTING_DOWN))
            raise
        for (_, future), sample in zip(waiters, group.samples):
            if not future.done():
                future.set_result(Completion(group.prompt_token_ids, sample, group.sampling))

    async def aclose(self) -> None:
        for call in self._calls:
            call.cancel()
        await asyncio.gather(*self._calls, return_exceptions=True)


class Episode:
    """One sample of a task: its env episode (pinned to one replica), transcript and tokens."""

    def __init__(self, task: TaskKey, sample: int, env: EnvPool, policy: PolicyPool, settings: AgentSettings) -> None:
        self.task, self.sample = task, sample
        self.env, self.policy, self.settings = env, policy, settings
        self.failed_replicas: set[Replica[EnvClient]] = set()
        self.started = time.monotonic()
        self.trace_id = ""
        self.error: str | None = None
        self._fresh_state()

    def _fresh_state(self) -> None:
        self.attempt_id = uuid.uuid4().hex  # request ids of this attempt: retries reuse them
        self.replica: Replica[EnvClient] | None = None
        self.episode_id = ""
        self.summary: dict[str, str] = {}
        self.transcript: list[common_pb2.ChatMessage] = []  # the whole conversation, for the record
        # What the policy sees: the transcript, or with the state view the latest observations.
        self.prompt: list[common_pb2.ChatMessage] = []
        self.tools: list[common_pb2.ToolSpec] = []
        self.trajectory = Trajectory()
        self.finish_reasons: list[FinishReasonName] = []  # one per policy turn in the trajectory
        self.step_rewards: list[float] = []  # one per Step
        self.steps = 0
        self.terminated = self.truncated = False
        self.reward: common_pb2.Reward | None = None

    @property
    def rollout_id(self) -> str:
        return self.task.rollout_id(self.sample)

    @property
    def state_view(self) -> bool:
        """The notebook's `observation: state`: each turn's prompt is the state alone, rendered whole;
        it does not extend the previous turn's tokens, so no `previous_token_ids` are sent."""
        return self.settings.options.get("observation") == "state"

    def _tokens_in_context(self) -> int:
        return self.trajectory.last_turn_tokens if self.state_view else len(self.trajectory.token_ids)

    # ---------------------------------------------------------------- the loop

    async def run(self, first_turn: SharedFirstTurn) -> RolloutRecord:
        attributes = {Attr.ENV_NAME: self.task.env, Attr.TASK_ID: self.task.group_id, Attr.SAMPLE_INDEX: self.sample,
                      Attr.GEN_AI_OPERATION_NAME: Operation.INVOKE_AGENT}
        with start_span(span_name(Operation.INVOKE_AGENT, self.task.env), **attributes) as span:
            self.trace_id = current_trace_id()
            try:
                await self._attempts(first_turn)
            except EpisodeFailed as failure:
                self.error = str(failure)
            finally:
                first_turn.leave(self.sample)
            record = self.record()
            span.set_attributes({
                Attr.REWARD_VALUE: record.reward, Attr.REWARD_STATUS: record.status.value,
                Attr.GEN_AI_USAGE_INPUT_TOKENS: record.tokens.prompt,
                Attr.GEN_AI_USAGE_OUTPUT_TOKENS: record.tokens.completion,
                "sciproto.steps": record.steps,
                **({Attr.POLICY_VERSION: record.policy_version.max} if record.policy_version.max is not None else {}),
            })
            return record

    async def _attempts(self, first_turn: SharedFirstTurn) -> None:
        restarts = self.settings.retries.episode_restarts
        for attempt in range(restarts + 1):
            try:
                try:
                    await self._open()
                    first = await self._first_turn(first_turn) if attempt == 0 else None
                    await self._play(first)
                finally:
                    await self._close()
                return
            except EpisodeFailed as failure:
                first_turn.leave(self.sample)
                if not failure.restartable or attempt == restarts:
                    suffix = f" (after {attempt} restarts)" if failure.restartable and attempt else ""
                    raise EpisodeFailed(f"{failure}{suffix}", restartable=False) from failure
                log.info("%s: starting again from Reset: %s", self.rollout_id, failure)
                self._fresh_state()

    async def _first_turn(self, shared: SharedFirstTurn) -> Completion:
        with start_span(span_name(Operation.CHAT), **{Attr.GEN_AI_OPERATION_NAME: Operation.CHAT}):
            try:
                return await shared.take(self.sample, self.prompt, self.tools)
            except SciprotoError as error:
                raise self._policy_failure(error) from error

    async def _play(self, completion: Completion | None) -> None:
        budget = self.settings
        while True:
            if completion is None:
                if self.steps >= budget.max_steps or self._tokens_in_context() >= budget.max_tokens:
                    self.truncated = True
                    break
                completion = await self._generate_turn()
                if completion is None:  # the prompt outgrew the model's context
                    self.truncated = True
                    break
            action = self._take_completion(completion)
            await self._step(action)
            completion = None
            if self.terminated or self.truncated:
                break
        await self._verify()

    # ---------------------------------------------------------------- policy

    async def _generate_turn(self) -> Completion | None:
        max_tokens = min(self.settings.sampling.max_tokens, self.settings.max_tokens - self._tokens_in_context())
        with start_span(span_name(Operation.CHAT), **{Attr.GEN_AI_OPERATION_NAME: Operation.CHAT,
                                                     Attr.GEN_AI_REQUEST_MAX_TOKENS: max_tokens}) as span:
            try:
                group = await generate(self.policy, self.settings, self.prompt, self.tools,
                                       previous_token_ids=() if self.state_view else self.trajectory.token_ids,
                                       max_tokens=max_tokens)
            except InvalidArgument as error:
                if error.reason == Reason.PROMPT_TOO_LONG:
                    return None
                raise self._policy_failure(error) from error
            except SciprotoError as error:
                raise self._policy_failure(error) from error
            span.set_attribute(Attr.POLICY_VERSION, group.policy_version)
            return Completion(group.prompt_token_ids, group.samples[0], group.sampling)

    def _policy_failure(self, error: SciprotoError) -> Exception:
        if isinstance(error, FATAL_ERRORS):
            return error
        return EpisodeFailed(f"policy Generate failed: {error.code.name} {error.reason}: {error.message}",
                             restartable=False)

    def _take_completion(self, completion: Completion) -> common_pb2.ChatMessage:
        """Append the turn's tokens and the assistant message; the message sent to the
        environment. A malformed tool call stays in `content` (the policy server leaves it there),
        so the environment can tell the agent what went wrong."""
        sample = completion.sample
        try:
            self.trajectory.add_turn(completion.prompt_token_ids, sample.completion_token_ids,
                                     sample.logprobs, sample.version_spans, extends=not self.state_view,
                                     sampling=completion.sampling)
        except TokenDriftError as error:
            raise EpisodeFailed(str(error), restartable=False) from error
        self.finish_reasons.append(finish_reason_name(sample.finish_reason))
        message = common_pb2.ChatMessage(role=common_pb2.ROLE_ASSISTANT, content=sample.content,
                                         tool_calls=sample.tool_calls)
        self.transcript.append(message)
        self.prompt.append(message)
        return message

    # ---------------------------------------------------------------- environment

    async def _env_call(self, what: str, operation: Callable[[EnvClient, float], Awaitable[T]],
                        deadline_s: float) -> T:
        """An env call on this episode's replica, retried; failures classified for the loop."""
        replica = self.replica
        assert replica is not None, "env call before Reset"
        try:
            return await with_retries(lambda timeout: operation(replica.client, timeout), self.settings.retries,
                                      deadline_s, f"{what} on {replica.target}")
        except Unavailable as error:
            self.env.mark_down(replica, error)
            self.failed_replicas.add(replica)
            raise EpisodeFailed(f"env replica {replica.target} unavailable during {what}: {error.message}",
                                restartable=True) from error
        except (DeadlineExceeded, ResourceExhausted) as error:
            self.failed_replicas.add(replica)
            raise EpisodeFailed(f"{what} on {replica.target}: {error.message}", restartable=True) from error
        except FATAL_ERRORS:
            raise
        except SciprotoError as error:
            if error.reason in TASK_REASONS:
                raise TaskRejected(f"environment refused task {self.task.group_id}: {error.message}") from error
            restartable = isinstance(error, NotFound) and error.reason == Reason.EPISODE_NOT_FOUND
            raise EpisodeFailed(f"{what} failed: {error.code.name} {error.reason}: {error.message}",
                                restartable=restartable) from error

    async def _open(self) -> None:
        try:
            self.replica = await self.env.acquire(exclude=frozenset(self.failed_replicas))
        except Unavailable as error:
            raise EpisodeFailed(str(error), restartable=False) from error
        task, request_id = self.task, f"{self.attempt_id}/reset"
        replica = self.replica

        def reset(client: EnvClient, timeout: float) -> Awaitable[env_pb2.ResetResponse]:
            return client.reset(task.env, split=task.split, index=task.index, request_id=request_id, timeout=timeout,
                                options=self.settings.options or None)

        with start_span(span_name(Operation.ENV_RESET, task.env), **{Attr.ENV_NAME: task.env}):
            try:
                response = await self._env_call("Reset", reset, self.settings.deadlines.reset_s)
            except asyncio.CancelledError:
                # The server may have opened the episode without us learning its id. A Reset
                # replayed with the same request_id names that episode (or opens one), so close it.
                async def close_orphan() -> None:
                    with contextlib.suppress(SciprotoError):
                        orphan = await call_with_deadline(lambda t: reset(replica.client, t),
                                                          self.settings.deadlines.close_s, "Reset replay")
                        close_id = f"{self.attempt_id}/close"
                        await call_with_deadline(
                            lambda t: replica.client.close(orphan.episode_id, request_id=close_id, timeout=t),
                            self.settings.deadlines.close_s, "Close")

                await finish_despite_cancellation(close_orphan())
                raise
        self.episode_id = response.episode_id
        self.transcript = list(response.observations)
        self.prompt = list(response.observations)
        self.tools = list(response.tools)
        self.summary = dict(response.task_summary)

    async def _step(self, action: common_pb2.ChatMessage) -> None:
        request_id = f"{self.attempt_id}/step/{self.steps}"
        with start_span(span_name(Operation.ENV_STEP, self.task.env),
                        **{Attr.ENV_NAME: self.task.env, Attr.EPISODE_ID: self.episode_id}) as span:
            response: env_pb2.StepResponse = await self._env_call(
                "Step", lambda client, timeout: client.step(self.episode_id, action, request_id=request_id,
                                                            timeout=timeout),
                self.settings.deadlines.step_s)
            span.set_attribute(Attr.REWARD_VALUE, response.reward.value)
        self.steps = max(self.steps + 1, response.step_count)
        self.step_rewards.append(response.reward.value)
        self.transcript.extend(response.observations)
        # The state view's observation is the whole state: it replaces the prompt.
        self.prompt = list(response.observations) if self.state_view else [*self.prompt, *response.observations]
        self.terminated, self.truncated = response.terminated, response.truncated
        if response.reward.status == common_pb2.REWARD_STATUS_INFRA_ERROR:
            raise EpisodeFailed(f"environment failed on step {self.steps}: {response.reward.detail or 'no detail'}",
                                restartable=False)

    async def _verify(self) -> None:
        with start_span(span_name(Operation.ENV_VERIFY, self.task.env),
                        **{Attr.ENV_NAME: self.task.env, Attr.EPISODE_ID: self.episode_id}) as span:
            response: env_pb2.VerifyResponse = await self._env_call(
                "Verify", lambda client, timeout: client.verify(self.episode_id, request_id=f"{self.attempt_id}/verify",
                                                                timeout=timeout),
                self.settings.deadlines.verify_s)
            span.set_attribute(Attr.REWARD_VALUE, response.reward.value)
        self.reward = response.reward
        if response.reward.status == common_pb2.REWARD_STATUS_INFRA_ERROR:
            raise EpisodeFailed(f"environment failed to verify: {response.reward.detail or 'no detail'}",
                                restartable=False)

    async def _close(self) -> None:
        """Close the episode (one try, errors only logged: the server's idle TTL is the backstop)
        and give the replica's lease back."""
        replica, self.replica = self.replica, None
        if replica is None:
            return
        try:
            if self.episode_id and replica.healthy:
                with start_span(span_name(Operation.ENV_CLOSE, self.task.env), **{Attr.EPISODE_ID: self.episode_id}):
                    await finish_despite_cancellation(call_with_deadline(
                        lambda timeout: replica.client.close(self.episode_id, request_id=f"{self.attempt_id}/close",
                                                             timeout=timeout),
                        self.settings.deadlines.close_s, "Close"))
        except SciprotoError as error:
            log.debug("closing %s on %s failed: %s", self.episode_id, replica.target, error)
        finally:
            self.env.release(replica)

    # ---------------------------------------------------------------- result

    def record(self) -> RolloutRecord:
        reward = self.reward or common_pb2.Reward()
        failed = self.error is not None
        return RolloutRecord(
            rollout_id=self.rollout_id, group_id=self.task.group_id, env=self.task.env, split=self.task.split,
            index=self.task.index, sample=self.sample, task=self.summary,
            status=RolloutStatus.INFRA_ERROR if failed else status_from_pb(reward.status),
            reward=0.0 if failed else reward.value,
            reward_components={} if failed else dict(reward.components),
            reward_detail=reward.detail, terminated=self.terminated, truncated=self.truncated, steps=self.steps,
            messages=[MessageRecord.from_pb(m) for m in self.transcript],
            token_ids=self.trajectory.token_ids, loss_mask=self.trajectory.loss_mask,
            logprobs=self.trajectory.logprobs, version_spans=self.trajectory.version_spans,
            sampling_spans=self.trajectory.sampling_spans, turn_finish_reasons=self.finish_reasons, step_rewards=self.step_rewards,
            tokens=self.trajectory.counts, policy_version=self.trajectory.versions,
            seconds=round(time.monotonic() - self.started, 4), trace_id=self.trace_id, error=self.error,
        )


async def run_group(task: TaskKey, samples: int, env: EnvPool, policy: PolicyPool,
                    settings: AgentSettings) -> RolloutGroup:
    """Run the `samples` episodes of `task` to the end; INFRA_ERROR records for those that
    failed. Raises TaskRejected when the environment refuses the task."""
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    first_turn_budget = min(settings.sampling.max_tokens, settings.max_tokens)
    shared = SharedFirstTurn(samples, lambda messages, tools, n: generate(
        policy, settings, messages, tools, n=n, max_tokens=first_turn_budget))
    episodes = [Episode(task, sample, env, policy, settings) for sample in range(samples)]
    try:
        async with asyncio.TaskGroup() as group:
            runs = [group.create_task(episode.run(shared)) for episode in episodes]
    except ExceptionGroup as errors:
        raise errors.exceptions[0] from None  # the first cause, e.g. TaskRejected
    finally:
        await shared.aclose()
    return RolloutGroup(task, [run.result() for run in runs])
