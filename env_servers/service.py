"""EnvironmentService: requests in, registry calls, responses out.

The operations (reset, step, fork, verify, close) are written once, as methods that take and
return protobuf messages; the unary RPCs and the Session stream both call them. Each runs in its
own span (`sciproto.env.step gsm8k`, ...), a child of the caller's span named by the request's
trace_context (see `sciproto.tracing.span_for_request`), with the env, episode id and reward.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

import grpc
from aviary.core import Environment
from opentelemetry.trace import INVALID_SPAN, Span

from env_servers import convert
from env_servers.catalog import (
    FORK_COPY,
    FORK_REPLAY,
    FORK_UNSUPPORTED,
    UNBOUNDED,
    EnvironmentSource,
    ReferenceUnsupportedError,
    RescoreUnsupportedError,
    reward_components,
)
from env_servers.config import EnvServerConfig
from env_servers.idempotency import IdempotencyCache
from env_servers.registry import EpisodeRegistry, StepOutcome
from env_servers.session import SessionStream
from sciproto.auth import current_principal
from sciproto.errors import (
    InvalidArgument,
    NotFound,
    Reason,
    SciprotoError,
    Unavailable,
    Unimplemented,
)
from sciproto.pb import ENV_SERVICE, common_pb2, env_grpc, env_pb2
from sciproto.server import server_info
from sciproto.tracing import Attr, Operation, span_for_request, span_name, tracing_enabled

log = logging.getLogger("env_servers.service")

CAPABILITIES = ("session", "session.heartbeat", "session.cancel", "session.max_in_flight", "fork", "verify.episode",
                "verify.trajectory", "inline_tasks", "idempotent_requests", "reference")

Response = TypeVar("Response")

_FORK_MODES = {FORK_COPY: env_pb2.FORK_MODE_COPY, FORK_REPLAY: env_pb2.FORK_MODE_REPLAY,
               FORK_UNSUPPORTED: env_pb2.FORK_MODE_UNSUPPORTED}


def _warm_pool(source: EnvironmentSource) -> env_pb2.WarmPool | None:
    stats = source.pool_stats()
    if stats is None:
        return None
    return env_pb2.WarmPool(size=stats.size, warm=stats.warm, starting=stats.starting, hits=stats.hits,
                            misses=stats.misses, replaced=stats.replaced, preload=stats.preload)


def _counts_errors(operation: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
    """Count every call of `operation` that ends in an error in the registry's counters."""

    @functools.wraps(operation)
    async def counted(self: EnvironmentService, request: Any, **options: Any) -> Response:
        try:
            return await operation(self, request, **options)
        except Exception:
            self.registry.counters.errors += 1
            raise

    return counted


class EnvironmentService(env_grpc.EnvironmentServiceServicer):
    """Hosts the environments of `sources` as configured."""

    def __init__(self, config: EnvServerConfig, sources: Mapping[str, EnvironmentSource]) -> None:
        self.config = config
        self.sources = dict(sources)
        # Split sizes never change; some Aviary datasets are slow to size, so ask once.
        self.splits = {name: dict(source.splits) for name, source in self.sources.items()}
        self.registry = EpisodeRegistry(config.max_live_episodes, config.idle_ttl_s,
                                        config.step_timeout_s, config.retry_after_s)
        self.idempotency = IdempotencyCache(config.idempotency_cache_size, config.idle_ttl_s)
        self.tools_seen: dict[str, list[common_pb2.ToolSpec]] = {}  # env -> tools of its last reset
        self.draining = False  # shutting down: no new episodes, operations on open ones go on

    def drain(self) -> None:
        """Open no new episodes from now on (Reset and Fork answer UNAVAILABLE SHUTTING_DOWN),
        also on Session streams already open, which the server's shutdown lets run out its grace
        period; operations on open episodes go on."""
        self.draining = True

    def start(self) -> None:
        self.registry.start()
        for source in self.sources.values():
            source.start(self._room)

    def _room(self) -> int:
        """Episodes the server may still open: what resources started ahead count against."""
        return self.config.max_live_episodes - self.registry.live - self.registry.opening

    async def aclose(self) -> None:
        await self.registry.aclose()
        for source in self.sources.values():
            try:
                await source.aclose()
            except Exception:
                log.warning("closing environment %s failed", source.name, exc_info=True)

    # ------------------------------------------------------------ operations

    def describe(self) -> env_pb2.EnvironmentServiceDescribeResponse:
        server = server_info(self.config.server, "sciproto-env", CAPABILITIES, service=ENV_SERVICE,
                             auth=self.config.auth)
        environments = [
            env_pb2.EnvironmentInfo(
                name=name, description=source.description, tools=self.tools_seen.get(name, []),
                provenance=self._provenance(name), fork=_FORK_MODES[source.fork_mode],
                reward_range=_reward_range(source),
                splits=[env_pb2.SplitInfo(name=split, size=max(size, 0), unbounded=size == UNBOUNDED)
                        for split, size in self.splits[name].items()],
                warm_pool=_warm_pool(source))
            for name, source in self.sources.items()
        ]
        counters = self.registry.counters
        return env_pb2.EnvironmentServiceDescribeResponse(
            server=server, environments=environments,
            limits=env_pb2.EnvironmentLimits(
                max_live_episodes=self.config.max_live_episodes, idle_ttl_seconds=self.config.idle_ttl_s,
                step_timeout_seconds=self.config.step_timeout_s,
                session_max_in_flight=self.config.session_max_in_flight),
            counters=env_pb2.EnvironmentCounters(
                live_episodes=self.registry.live, episodes_opened=counters.opened,
                episodes_expired=counters.expired, steps=counters.steps, errors=counters.errors))

    @_counts_errors
    async def reset(self, request: env_pb2.ResetRequest, *, context: grpc.aio.ServicerContext | None = None,
                    detach: bool = True) -> env_pb2.ResetResponse:
        """detach: finish even if the caller goes away (see IdempotencyCache.run)."""
        task_id = (f"{request.env}/{request.task_ref.split}/{request.task_ref.index}"
                   if request.HasField("task_ref") else None)
        with span_for_request(span_name(Operation.ENV_RESET, request.env), context, request.trace_context,
                              **{Attr.ENV_NAME: request.env, Attr.TASK_ID: task_id}) as span:
            response = await self.idempotency.run(_scoped("reset"), request.request_id, _reset_fingerprint(request),
                                                  lambda: self._reset(request), detach=detach)
            span.set_attribute(Attr.EPISODE_ID, response.episode_id)
            return response

    async def _reset(self, request: env_pb2.ResetRequest) -> env_pb2.ResetResponse:
        self._refuse_if_draining("Reset")
        source = self._source(request.env)
        options = dict(request.options)
        try:
            source.check_episode_options(options)
        except ValueError as error:
            raise InvalidArgument(str(error), Reason.INVALID_REQUEST) from None
        which = request.WhichOneof("task")
        if which == "task_ref":
            split, index = request.task_ref.split, request.task_ref.index
            self._check_task(request.env, split, index)
            summary, task_id = source.task_summary(split, index), source.task_id(split, index)
            make: Callable[[], Awaitable[Environment]] = lambda: source.make(split, index)
        elif which == "inline_task":
            fields = dict(request.inline_task.fields)
            summary, make, task_id = fields, lambda: _make_inline(source, fields), source.inline_task_id(fields)
        else:
            raise InvalidArgument("ResetRequest names no task: set task_ref {split, index} or inline_task",
                                  Reason.INVALID_REQUEST)
        seed = request.seed if request.HasField("seed") else None
        if options:
            make = functools.partial(_configured, source, make, options)
        episode, observations = await self.registry.open(request.env, make, seed)
        tools = convert.tools_to_proto(episode.tools)
        self.tools_seen[request.env] = tools
        return env_pb2.ResetResponse(episode_id=episode.id, observations=convert.messages_to_proto(observations),
                                     tools=tools, task_summary=summary, task_id=task_id)

    @_counts_errors
    async def step(self, request: env_pb2.StepRequest, *, context: grpc.aio.ServicerContext | None = None,
                   detach: bool = True) -> env_pb2.StepResponse:
        fingerprint = (request.episode_id, request.action.SerializeToString())
        with self._episode_span(Operation.ENV_STEP, request, request.episode_id, context) as span:
            response = await self.idempotency.run(_scoped("step"), request.request_id, fingerprint,
                                                  lambda: self._step(request), detach=detach)
            _record_reward(span, response.reward)
            return response

    async def _step(self, request: env_pb2.StepRequest) -> env_pb2.StepResponse:
        episode = self.registry.get(request.episode_id)
        action = convert.action_from_proto(request.action, episode.tools)
        outcome = await self.registry.step(episode, action.message)
        convert.explain_invalid_calls(outcome.observations, action.invalid_calls)
        response = _step_response(outcome)
        response.reward.provenance.CopyFrom(self._provenance(episode.env_name))
        return response

    @_counts_errors
    async def fork(self, request: env_pb2.ForkRequest, *, context: grpc.aio.ServicerContext | None = None,
                   detach: bool = True) -> env_pb2.ForkResponse:
        """detach: as for reset. A retry with the same request_id answers the same fork."""
        with self._episode_span(Operation.ENV_FORK, request, request.episode_id, context) as span:
            response = await self.idempotency.run(_scoped("fork"), request.request_id, request.episode_id,
                                                  lambda: self._fork(request), detach=detach)
            if span.is_recording():
                span.set_attribute(Attr.FORK_EPISODE_ID, response.episode_id)
            return response

    async def _fork(self, request: env_pb2.ForkRequest) -> env_pb2.ForkResponse:
        self._refuse_if_draining("Fork")
        parent = self.registry.get(request.episode_id)
        source = self.sources[parent.env_name]
        if source.fork_mode == FORK_UNSUPPORTED:
            raise Unimplemented(f"environment {parent.env_name!r} cannot fork an episode (Describe: fork"
                                " unsupported); Reset a new episode and replay its actions instead",
                                Reason.UNSUPPORTED)
        fork = await self.registry.fork(parent, source.fork)
        return env_pb2.ForkResponse(episode_id=fork.id, parent_episode_id=parent.id, step_count=fork.step_count,
                                    tools=convert.tools_to_proto(fork.tools))

    @_counts_errors
    async def verify(self, request: env_pb2.VerifyRequest, *,
                     context: grpc.aio.ServicerContext | None = None) -> env_pb2.VerifyResponse:
        which = request.WhichOneof("target")
        if which == "trajectory":
            with span_for_request(span_name(Operation.ENV_VERIFY, request.trajectory.env), context,
                                  request.trace_context, **{Attr.ENV_NAME: request.trajectory.env}) as span:
                reward = await self._trajectory_reward(request.trajectory)
                reward.provenance.CopyFrom(self._provenance(request.trajectory.env))
                _record_reward(span, reward)
                return env_pb2.VerifyResponse(reward=reward)
        if which == "episode_id":
            with self._episode_span(Operation.ENV_VERIFY, request, request.episode_id, context) as span:
                reward = self._episode_reward(request.episode_id)
                reward.provenance.CopyFrom(self._provenance(self.registry.get(request.episode_id).env_name))
                _record_reward(span, reward)
                return env_pb2.VerifyResponse(reward=reward)
        raise InvalidArgument("VerifyRequest names nothing to grade: set episode_id or trajectory",
                              Reason.INVALID_REQUEST)

    @_counts_errors
    async def reference(self, request: env_pb2.ReferenceRequest, *,
                        context: grpc.aio.ServicerContext | None = None) -> env_pb2.ReferenceResponse:
        """The reference actions of a dataset task: they reveal its answer (the grader role)."""
        source = self._source(request.env)
        if not request.HasField("task_ref"):
            raise InvalidArgument("ReferenceRequest names no task: set task_ref {split, index}", Reason.INVALID_REQUEST)
        split, index = request.task_ref.split, request.task_ref.index
        self._check_task(request.env, split, index)
        try:
            actions = source.reference_actions(split, index)
        except ReferenceUnsupportedError as error:
            raise Unimplemented(str(error), Reason.UNSUPPORTED) from None
        return env_pb2.ReferenceResponse(actions=[convert.message_to_proto(action) for action in actions])

    def _episode_reward(self, episode_id: str) -> common_pb2.Reward:
        """The episode's return as it stands: SCORED once it terminated; before that (or when
        cut short) SCORED as a missing answer where the environment grades one, else UNSCORED;
        INFRA_ERROR if its environment failed."""
        episode = self.registry.get(episode_id)
        episode.touch()
        if episode.failure is not None:
            return common_pb2.Reward(status=common_pb2.REWARD_STATUS_INFRA_ERROR, detail=episode.failure)
        if episode.terminated:
            return common_pb2.Reward(value=episode.total_reward, components=reward_components(episode.env),
                                     status=common_pb2.REWARD_STATUS_SCORED)
        state = "was truncated before it terminated" if episode.truncated else "has not terminated yet"
        unanswered = self.sources[episode.env_name].unanswered_reward(episode.env)
        if unanswered is None:
            return common_pb2.Reward(value=episode.total_reward, status=common_pb2.REWARD_STATUS_UNSCORED,
                                     detail=f"the episode {state} ({episode.step_count} steps)")
        value, components = unanswered
        # return = rewards of the steps so far + the grade of the missing answer
        return common_pb2.Reward(value=episode.total_reward + value, components=components,
                                 status=common_pb2.REWARD_STATUS_SCORED,
                                 detail=f"the episode {state} ({episode.step_count} steps) without an answer:"
                                        " graded as a wrong answer")

    async def _trajectory_reward(self, trajectory: env_pb2.StoredTrajectory) -> common_pb2.Reward:
        source = self._source(trajectory.env)
        messages = [convert.message_from_proto(message) for message in trajectory.messages]
        which = trajectory.WhichOneof("task")
        if which == "task_ref":
            split, index = trajectory.task_ref.split, trajectory.task_ref.index
            self._check_task(trajectory.env, split, index)
            rescore = lambda: source.rescore(split, index, messages)
        elif which == "inline_task":
            fields = dict(trajectory.inline_task.fields)
            rescore = lambda: _rescore_inline(source, fields, messages)
        else:
            raise InvalidArgument("StoredTrajectory names no task: set task_ref {split, index} or inline_task",
                                  Reason.INVALID_REQUEST)
        try:
            value, components = await rescore()
        except RescoreUnsupportedError as error:
            raise Unimplemented(f"{error}; Verify the live episode instead", Reason.UNSUPPORTED) from None
        except SciprotoError:
            raise
        except Exception as error:
            log.warning("%s: rescore raised", trajectory.env, exc_info=True)
            self.registry.counters.errors += 1
            return common_pb2.Reward(status=common_pb2.REWARD_STATUS_INFRA_ERROR,
                                     detail=f"re-scoring raised {type(error).__name__}: {error}")
        return common_pb2.Reward(value=value, components=components, status=common_pb2.REWARD_STATUS_SCORED)

    @_counts_errors
    async def close(self, request: env_pb2.CloseRequest, *,
                    context: grpc.aio.ServicerContext | None = None) -> env_pb2.CloseResponse:
        with self._episode_span(Operation.ENV_CLOSE, request, request.episode_id, context):
            return env_pb2.CloseResponse(closed=await self.registry.close(request.episode_id))

    def _episode_span(self, operation: str, request: Any, episode_id: str,
                      context: grpc.aio.ServicerContext | None) -> contextlib.AbstractContextManager[Span]:
        """The span of an operation on an open episode, named after the episode's environment."""
        if not tracing_enabled():  # no span to name: skip the lookup
            return contextlib.nullcontext(INVALID_SPAN)
        episode = self.registry.find(episode_id)
        env = episode.env_name if episode is not None else None
        return span_for_request(span_name(operation, env), context, request.trace_context,
                                **{Attr.ENV_NAME: env, Attr.EPISODE_ID: episode_id})

    def _provenance(self, env: str) -> common_pb2.Provenance:
        environment_version, grader_version = self.sources[env].versions
        return common_pb2.Provenance(environment=env, environment_version=environment_version,
                                     grader_version=grader_version)

    # ------------------------------------------------------------ checks

    def _refuse_if_draining(self, operation: str) -> None:
        if self.draining:
            raise Unavailable(f"this env server is shutting down: it finishes the episodes it has but opens no"
                              f" new ones; send the {operation} to another replica", Reason.SHUTTING_DOWN)

    def _source(self, env: str) -> EnvironmentSource:
        source = self.sources.get(env)
        if source is None:
            raise NotFound(f"this server hosts no environment {env!r}; it hosts {sorted(self.sources)}",
                           Reason.UNKNOWN_ENVIRONMENT, metadata={"environments": ",".join(sorted(self.sources))})
        return source

    def _check_task(self, env: str, split: str, index: int) -> None:
        splits = self.splits[env]
        if split not in splits:
            raise NotFound(f"environment {env!r} has no split {split!r}; its splits are {sorted(splits)}",
                           Reason.UNKNOWN_SPLIT, metadata={"splits": ",".join(sorted(splits))})
        size = splits[split]
        if size != UNBOUNDED and index >= size:
            raise InvalidArgument(
                f"task index {index} is out of range: split {split!r} of {env!r} has {size} tasks"
                f" (indices 0..{size - 1})", Reason.TASK_OUT_OF_RANGE, metadata={"split_size": str(size)})

    # ------------------------------------------------------------ RPCs

    async def Describe(self, request: env_pb2.EnvironmentServiceDescribeRequest,
                       context: grpc.aio.ServicerContext) -> env_pb2.EnvironmentServiceDescribeResponse:
        return self.describe()

    async def Reset(self, request: env_pb2.ResetRequest,
                    context: grpc.aio.ServicerContext) -> env_pb2.ResetResponse:
        return await self.reset(request, context=context)

    async def Step(self, request: env_pb2.StepRequest,
                   context: grpc.aio.ServicerContext) -> env_pb2.StepResponse:
        return await self.step(request, context=context)

    async def Verify(self, request: env_pb2.VerifyRequest,
                     context: grpc.aio.ServicerContext) -> env_pb2.VerifyResponse:
        return await self.verify(request, context=context)

    async def Close(self, request: env_pb2.CloseRequest,
                    context: grpc.aio.ServicerContext) -> env_pb2.CloseResponse:
        return await self.close(request, context=context)

    async def Reference(self, request: env_pb2.ReferenceRequest,
                        context: grpc.aio.ServicerContext) -> env_pb2.ReferenceResponse:
        return await self.reference(request, context=context)

    async def Fork(self, request: env_pb2.ForkRequest,
                   context: grpc.aio.ServicerContext) -> env_pb2.ForkResponse:
        return await self.fork(request, context=context)

    async def Session(self, request_iterator: AsyncIterator[env_pb2.SessionRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[env_pb2.SessionResponse]:
        stream = SessionStream(self, self.config.heartbeat_interval_s, context,
                               max_in_flight=self.config.session_max_in_flight)
        async for response in stream.run(request_iterator):
            yield response


def _reward_range(source: EnvironmentSource) -> env_pb2.RewardRange | None:
    if source.reward_range is None:
        return None
    low, high, baseline = source.reward_range
    return env_pb2.RewardRange(min=low, max=high, baseline=baseline)


async def _configured(source: EnvironmentSource, make: Callable[[], Awaitable[Environment]],
                      options: dict[str, str]) -> Environment:
    env = await make()
    source.configure(env, options)
    return env


async def _make_inline(source: EnvironmentSource, fields: dict[str, str]) -> Environment:
    try:
        return await source.make_inline(fields)
    except ValueError as error:
        raise InvalidArgument(f"inline task for {source.name!r}: {error}", Reason.INVALID_REQUEST) from None


async def _rescore_inline(source: EnvironmentSource, fields: dict[str, str],
                          messages: list[Any]) -> tuple[float, dict[str, float]]:
    try:
        return await source.rescore_inline(fields, messages)
    except ValueError as error:
        raise InvalidArgument(f"inline task for {source.name!r}: {error}", Reason.INVALID_REQUEST) from None


def _scoped(operation: str) -> str:
    """The idempotency namespace of `operation` for the calling principal: a request_id one
    principal chose never answers with another principal's result."""
    principal = current_principal()
    return f"{operation} by {principal.name}" if principal is not None else operation


def _reset_fingerprint(request: env_pb2.ResetRequest) -> bytes:
    """What a Reset asks for: the request without its id and trace context (a retry sent from
    another span is still the same Reset)."""
    asked = env_pb2.ResetRequest()
    asked.CopyFrom(request)
    asked.ClearField("request_id")
    asked.ClearField("trace_context")
    return asked.SerializeToString(deterministic=True)


def _record_reward(span: Span, reward: common_pb2.Reward) -> None:
    if span.is_recording():
        span.set_attributes({
            Attr.REWARD_VALUE: reward.value,
            Attr.REWARD_STATUS: common_pb2.RewardStatus.Name(reward.status).removeprefix("REWARD_STATUS_"),
        })


def _step_response(outcome: StepOutcome) -> env_pb2.StepResponse:
    response = env_pb2.StepResponse(
        observations=convert.messages_to_proto(outcome.observations), terminated=outcome.terminated,
        truncated=outcome.truncated, step_count=outcome.step_count)
    if outcome.failure is not None:
        response.reward.status = common_pb2.REWARD_STATUS_INFRA_ERROR
        response.reward.detail = response.info["error"] = outcome.failure
    else:
        response.reward.value, response.reward.status = outcome.reward, common_pb2.REWARD_STATUS_SCORED
        response.reward.components.update(outcome.components)
    return response

