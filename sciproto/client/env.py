"""Async client of EnvironmentService.

    async with EnvClient("127.0.0.1:50051") as env:
        reset = await env.reset("gsm8k", split="test", index=0)
        step = await env.step(reset.episode_id, tool_calls_action(("calculator", {"expr": "6*7"})))
        async with env.session() as session:          # many episodes on one stream
            a, b = await asyncio.gather(session.reset("toy", split="train", index=0),
                                        session.reset("toy", split="train", index=1))

The operations of an EnvClient share one Session stream (see EnvClient for what its end means);
`EnvClient(target, transport="unary")` makes one unary call per operation instead.

Every call carries a request_id (fresh unless the caller passes one to retry an operation), so
gRPC's own retries (on UNAVAILABLE) never apply an operation twice, and the current span in its
trace_context, so the server's spans join the caller's trace even when many episodes share one
Session stream. Failures are raised as `sciproto.errors.SciprotoError` subclasses, whose
`reason` says what happened, on unary calls and on the stream alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Literal, Self

import grpc

from sciproto.channel import ChannelConfig, make_channel
from sciproto.client.protocol import check_protocol
from sciproto.errors import (
    DeadlineExceeded,
    Internal,
    Reason,
    SciprotoError,
    Unavailable,
    from_rpc_error,
    from_status,
)
from sciproto.pb import common_pb2, env_grpc, env_pb2
from sciproto.tracing import current_trace_context, outside_any_trace

# How long leaving a session waits for the server to answer what is still in flight.
SESSION_DRAIN_TIMEOUT_S = 10.0
# Bound on an operation's wait when neither the caller nor the ChannelConfig gives one.
DEFAULT_TIMEOUT_S = 60.0
# Most lost episodes (opened on a stream that ended, not closed since) a client remembers.
MAX_LOST_EPISODES = 4096
# Tries at a new shared stream whose connection turns out dead before the server sent anything on
# it, and the pause before the next (times the try's number): gRPC may hand a new stream the
# connection that has just closed, until it has seen that connection go.
NEW_STREAM_ATTEMPTS = 3
NEW_STREAM_BACKOFF_S = 0.05


def _fresh_request_ids() -> None:
    global _REQUEST_ID_PREFIX, _request_counter
    _REQUEST_ID_PREFIX, _request_counter = uuid.uuid4().hex, itertools.count()


_fresh_request_ids()
os.register_at_fork(after_in_child=_fresh_request_ids)  # a forked child must not repeat the parent's ids


def new_request_id() -> str:
    """A request id unique with a uuid4's odds: this process's random 128-bit prefix and a counter
    (a fraction of uuid4's cost, which is paid on every operation)."""
    return f"{_REQUEST_ID_PREFIX}-{next(_request_counter):x}"


def tool_calls_action(*calls: tuple[str, Mapping[str, Any]], content: str = "") -> common_pb2.ChatMessage:
    """An assistant action calling tools: `tool_calls_action(("calculator", {"expr": "1+1"}))`."""
    return common_pb2.ChatMessage(
        role=common_pb2.ROLE_ASSISTANT, content=content,
        tool_calls=[common_pb2.ToolCall(id=f"call_{uuid.uuid4().hex[:12]}", name=name, arguments=json.dumps(args))
                    for name, args in calls])


def reset_request(env: str, *, split: str | None = None, index: int | None = None,
                  inline: Mapping[str, str] | None = None, seed: int | None = None,
                  request_id: str | None = None,
                  options: Mapping[str, str] | None = None) -> env_pb2.ResetRequest:
    """A ResetRequest for a dataset task (split and index) or an inline task (its fields), with
    the environment's per-episode `options` (notebook: {"observation": "history" | "state"})."""
    if (inline is None) == (split is None or index is None):
        raise ValueError("reset takes either split= and index= (a dataset task) or inline= (task fields)")
    request = env_pb2.ResetRequest(request_id=request_id or new_request_id(), env=env, seed=seed,
                                   trace_context=current_trace_context(), options=options)
    if inline is not None:
        request.inline_task.fields.update(inline)
    else:
        request.task_ref.split, request.task_ref.index = split, index
    return request


def verify_request(episode_id: str | None = None, *, trajectory: env_pb2.StoredTrajectory | None = None,
                   request_id: str | None = None) -> env_pb2.VerifyRequest:
    if (episode_id is None) == (trajectory is None):
        raise ValueError("verify takes either an episode_id or a trajectory")
    request = env_pb2.VerifyRequest(request_id=request_id or new_request_id(), trace_context=current_trace_context())
    if trajectory is not None:
        request.trajectory.CopyFrom(trajectory)
    else:
        request.episode_id = episode_id
    return request


def step_request(episode_id: str, action: common_pb2.ChatMessage,
                 request_id: str | None = None) -> env_pb2.StepRequest:
    return env_pb2.StepRequest(request_id=request_id or new_request_id(), episode_id=episode_id, action=action,
                               trace_context=current_trace_context())


def fork_request(episode_id: str, request_id: str | None = None) -> env_pb2.ForkRequest:
    return env_pb2.ForkRequest(request_id=request_id or new_request_id(), episode_id=episode_id,
                               trace_context=current_trace_context())


def close_request(episode_id: str, request_id: str | None = None) -> env_pb2.CloseRequest:
    return env_pb2.CloseRequest(request_id=request_id or new_request_id(), episode_id=episode_id,
                                trace_context=current_trace_context())


class EnvClient:
    """The operations of EnvironmentService on one channel.

    transport="session" (the default): every operation but Describe travels on one Session
    stream that the client opens on first use and shares among all its callers, each
    operation matched to its answer by request_id. A stream message costs the server and the
    client less than a unary call (one call set-up, interceptors run once per stream).
    transport="unary": one unary RPC per operation.

    What a stream's end means (the protocol closes every episode opened on a Session stream
    when the stream ends, however it ends):

    - operations in flight on it fail with the error that ended it (UNAVAILABLE when the
      server died or the connection dropped), which callers retry within their bounds;
    - the next operation opens a new stream (one open at a time). A new stream that ends
      UNAVAILABLE (or INTERNAL, gRPC's error for a write on it) before the server has sent
      anything on it (gRPC may give it the connection that has just closed) is opened again,
      NEW_STREAM_ATTEMPTS times at most, within the operation's timeout: no episode of it can
      be lost, and a Step retried carries its request_id. Any other failed open fails the
      operation with its status, so the caller's bounded retries bound the re-opens;
    - an episode opened on the ended stream is lost: the server has closed it. Every later
      operation on it raises the stream's error at once (the same class, so a dead server is
      reported as UNAVAILABLE exactly as over unary calls, and the agent starts the episode
      again from Reset on another replica); closing it answers closed=False without a call.

    Episodes opened on the shared stream live until they are closed, expire, or the client is
    closed (aclose ends the stream). Use transport="unary" for episodes that must outlive
    the client or a dropped connection. The stream carries the bearer token it was opened
    with (the channel's interceptors run when it opens); a token changed on disk applies from
    the next stream. Every wait has a bound: `timeout`, else `default_timeout_s` (the
    ChannelConfig's default_timeout_s when given one, else 60 s), covers waiting for a free
    slot (at most `max_in_flight` operations in flight, the server's default limit), the
    write and the answer.
    """

    def __init__(self, channel_or_config: grpc.aio.Channel | ChannelConfig | str, *,
                 transport: Literal["session", "unary"] = "session", default_timeout_s: float | None = None,
                 max_in_flight: int = 256) -> None:
        if transport not in ("session", "unary"):
            raise ValueError(f"transport is 'session' or 'unary', not {transport!r}")
        if isinstance(channel_or_config, str):
            channel_or_config = ChannelConfig(target=channel_or_config)
        self.target = channel_or_config.target if isinstance(channel_or_config, ChannelConfig) else ""
        if isinstance(channel_or_config, ChannelConfig):
            self._channel, self._owns_channel = make_channel(channel_or_config, bare_streams=True), True
            default_timeout_s = default_timeout_s or channel_or_config.default_timeout_s
        else:
            self._channel, self._owns_channel = channel_or_config, False
        self._stub = env_grpc.EnvironmentServiceStub(self._channel)
        self.transport = transport
        self.default_timeout_s = default_timeout_s or DEFAULT_TIMEOUT_S
        self.max_in_flight = max_in_flight
        self._stream: EnvSession | None = None
        self._opening: asyncio.Lock | None = None  # made on first use, inside the event loop
        self._slots: asyncio.Semaphore | None = None
        self._lost: dict[str, SciprotoError] = {}  # episode id -> why (its stream ended)
        self._closed = False

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """End the shared stream (the server closes the episodes opened on it), then close the
        channel if this client made it."""
        self._closed = True
        stream, self._stream = self._stream, None
        if stream is not None:
            await stream.aclose()
        if self._owns_channel:
            await self._channel.close()

    async def _call(self, method: Any, request: Any, timeout: float | None) -> Any:
        try:
            return await method(request, timeout=timeout)
        except grpc.aio.AioRpcError as error:
            raise from_rpc_error(error) from None

    # ------------------------------------------------------------ the shared stream

    async def _on_stream(self, request: env_pb2.SessionRequest, request_id: str,
                         timeout: float | None) -> env_pb2.SessionResponse:
        deadline = time.monotonic() + (timeout or self.default_timeout_s)
        attempt = 1
        while True:
            stream = self._stream
            if stream is None or stream.failure is not None:
                stream = await self._live_stream()
            try:
                return await stream.run(request, request_id, max(deadline - time.monotonic(), 0.001))
            except (Unavailable, Internal):
                # Nothing came back on it: the stream never reached a live server (and the
                # server closes whatever it may have opened on it). Its end is UNAVAILABLE, or
                # INTERNAL ("Internal error from Core") where gRPC failed the write on it first.
                if stream.received or attempt >= NEW_STREAM_ATTEMPTS or time.monotonic() >= deadline:
                    raise
                if self._stream is stream:
                    self._stream = None  # dead, even if its reader has not said so yet
            await asyncio.sleep(NEW_STREAM_BACKOFF_S * attempt)
            attempt += 1

    async def _live_stream(self) -> EnvSession:
        if self._closed:
            raise Unavailable("this EnvClient is closed", Reason.SHUTTING_DOWN)
        if self._opening is None:
            self._opening = asyncio.Lock()
            self._slots = asyncio.Semaphore(self.max_in_flight)
        async with self._opening:  # concurrent callers share the one new stream
            stream = self._stream
            if stream is None or stream.failure is not None:
                # Each operation names its episode's trace in its trace_context; the stream
                # itself (its RPC span, its reader task) belongs to no episode.
                with outside_any_trace():
                    stream = self._stream = EnvSession(self._stub.Session(), self.default_timeout_s,
                                                       slots=self._slots, on_end=self._stream_ended)
            return stream

    def _stream_ended(self, stream: EnvSession, failure: SciprotoError) -> None:
        """`stream` ended: its episodes are lost (the server closes them with the stream)."""
        if self._stream is stream:
            self._stream = None
        for episode_id in stream.opened:
            if len(self._lost) >= MAX_LOST_EPISODES:  # bounded: an evicted one gets the server's NOT_FOUND
                del self._lost[next(iter(self._lost))]
            self._lost[episode_id] = type(failure)(
                f"episode {episode_id} was opened on a Session stream that ended ({failure.code.name}:"
                f" {failure.message}); the server closed it with the stream: start it again from Reset",
                failure.reason, code=failure.code, metadata=failure.metadata)
        stream.opened.clear()

    def _check_episode(self, episode_id: str) -> None:
        lost = self._lost.get(episode_id)
        if lost is not None:
            raise lost

    # ------------------------------------------------------------ operations

    async def describe(self, timeout: float | None = None) -> env_pb2.EnvironmentServiceDescribeResponse:
        """The server's Describe; FailedPrecondition (INCOMPATIBLE_PROTOCOL) when it speaks
        another major protocol version (sciproto.client.protocol)."""
        request = env_pb2.EnvironmentServiceDescribeRequest(request_id=new_request_id(),
                                                            trace_context=current_trace_context())
        described = await self._call(self._stub.Describe, request, timeout)
        check_protocol(described.server, "environment", self.target)
        return described

    async def reset(self, env: str, *, split: str | None = None, index: int | None = None,
                    inline: Mapping[str, str] | None = None, seed: int | None = None,
                    request_id: str | None = None, timeout: float | None = None,
                    options: Mapping[str, str] | None = None) -> env_pb2.ResetResponse:
        request = reset_request(env, split=split, index=index, inline=inline, seed=seed, request_id=request_id,
                                options=options)
        if self.transport == "unary":
            return await self._call(self._stub.Reset, request, timeout)
        return (await self._on_stream(env_pb2.SessionRequest(reset=request), request.request_id, timeout)).reset

    async def step(self, episode_id: str, action: common_pb2.ChatMessage, *, request_id: str | None = None,
                   timeout: float | None = None) -> env_pb2.StepResponse:
        """Pass the same request_id to retry a step safely: the server answers with the first result."""
        request = step_request(episode_id, action, request_id)
        if self.transport == "unary":
            return await self._call(self._stub.Step, request, timeout)
        self._check_episode(episode_id)
        return (await self._on_stream(env_pb2.SessionRequest(step=request), request.request_id, timeout)).step

    async def verify(self, episode_id: str | None = None, *, trajectory: env_pb2.StoredTrajectory | None = None,
                     request_id: str | None = None, timeout: float | None = None) -> env_pb2.VerifyResponse:
        request = verify_request(episode_id, trajectory=trajectory, request_id=request_id)
        if self.transport == "unary":
            return await self._call(self._stub.Verify, request, timeout)
        if episode_id is not None:
            self._check_episode(episode_id)
        return (await self._on_stream(env_pb2.SessionRequest(verify=request), request.request_id, timeout)).verify

    async def reference(self, env: str, *, split: str, index: int,
                        timeout: float | None = None) -> list[common_pb2.ChatMessage]:
        """The reference actions of a dataset task (the environment's own solution), to Step in
        order after Reset; UNIMPLEMENTED when the environment has none."""
        request = env_pb2.ReferenceRequest(request_id=new_request_id(), env=env, trace_context=current_trace_context(),
                                           task_ref=env_pb2.TaskRef(split=split, index=index))
        return list((await self._call(self._stub.Reference, request, timeout)).actions)

    async def fork(self, episode_id: str, *, request_id: str | None = None,
                   timeout: float | None = None) -> env_pb2.ForkResponse:
        """A new episode copied from `episode_id` at its current step; close it like any episode.
        Pass the same request_id to retry: the server answers with the same fork."""
        request = fork_request(episode_id, request_id)
        if self.transport == "unary":
            return await self._call(self._stub.Fork, request, timeout)
        self._check_episode(episode_id)
        return (await self._on_stream(env_pb2.SessionRequest(fork=request), request.request_id, timeout)).fork

    async def close(self, episode_id: str, *, request_id: str | None = None,
                    timeout: float | None = None) -> env_pb2.CloseResponse:
        request = close_request(episode_id, request_id)
        if self.transport == "unary":
            return await self._call(self._stub.Close, request, timeout)
        if self._lost.pop(episode_id, None) is not None:
            return env_pb2.CloseResponse(closed=False)  # the server closed it when its stream ended
        return (await self._on_stream(env_pb2.SessionRequest(close=request), request.request_id, timeout)).close

    @contextlib.asynccontextmanager
    async def session(self, operation_timeout_s: float = 300.0) -> AsyncIterator[EnvSession]:
        """A Session stream of its own for the duration of the block. Leaving the block ends the
        stream, and the server closes every episode opened on it."""
        session = EnvSession(self._stub.Session(), operation_timeout_s)
        try:
            yield session
        finally:
            await session.aclose()


class EnvSession:
    """Operations on one Session stream, each an awaitable matched to its answer by request_id.
    Operations may run concurrently; heartbeats are absorbed here. `opened`: the episodes
    opened here and not closed here (the server closes them when the stream ends)."""

    def __init__(self, call: grpc.aio.StreamStreamCall, operation_timeout_s: float, *,
                 slots: asyncio.Semaphore | None = None,
                 on_end: Callable[[EnvSession, SciprotoError], None] | None = None) -> None:
        self._call = call
        self.operation_timeout_s = operation_timeout_s
        self.last_heartbeat: env_pb2.SessionResponse | None = None
        self.opened: set[str] = set()
        # request_id -> its callers, oldest first: a retry sent while the first try is still in
        # flight gets the next answer with that id (the server answers both, alike).
        self._waiting: dict[str, list[asyncio.Future[env_pb2.SessionResponse]]] = {}
        self._write_lock = asyncio.Lock()  # gRPC allows one pending write per stream
        self._slots = slots
        self._on_end = on_end
        self.failure: SciprotoError | None = None
        self.received = 0  # messages the server has sent on this stream (heartbeats too)
        self._reader = asyncio.ensure_future(self._read())

    async def reset(self, env: str, *, split: str | None = None, index: int | None = None,
                    inline: Mapping[str, str] | None = None, seed: int | None = None,
                    request_id: str | None = None, timeout: float | None = None,
                    options: Mapping[str, str] | None = None) -> env_pb2.ResetResponse:
        request = reset_request(env, split=split, index=index, inline=inline, seed=seed, request_id=request_id,
                                options=options)
        return (await self.run(env_pb2.SessionRequest(reset=request), request.request_id, timeout)).reset

    async def step(self, episode_id: str, action: common_pb2.ChatMessage, *, request_id: str | None = None,
                   timeout: float | None = None) -> env_pb2.StepResponse:
        request = step_request(episode_id, action, request_id)
        return (await self.run(env_pb2.SessionRequest(step=request), request.request_id, timeout)).step

    async def verify(self, episode_id: str | None = None, *, trajectory: env_pb2.StoredTrajectory | None = None,
                     request_id: str | None = None, timeout: float | None = None) -> env_pb2.VerifyResponse:
        request = verify_request(episode_id, trajectory=trajectory, request_id=request_id)
        return (await self.run(env_pb2.SessionRequest(verify=request), request.request_id, timeout)).verify

    async def fork(self, episode_id: str, *, request_id: str | None = None,
                   timeout: float | None = None) -> env_pb2.ForkResponse:
        """As EnvClient.fork, on this stream: the fork is closed with the stream at the latest."""
        request = fork_request(episode_id, request_id)
        return (await self.run(env_pb2.SessionRequest(fork=request), request.request_id, timeout)).fork

    async def close(self, episode_id: str, *, request_id: str | None = None,
                    timeout: float | None = None) -> env_pb2.CloseResponse:
        request = close_request(episode_id, request_id)
        return (await self.run(env_pb2.SessionRequest(close=request), request.request_id, timeout)).close

    async def run(self, request: env_pb2.SessionRequest, request_id: str,
                  timeout: float | None) -> env_pb2.SessionResponse:
        """Send `request` and wait for its answer, all within `timeout` (else the session's
        operation timeout): a free slot, the write, the answer."""
        if self.failure is not None:
            raise self.failure
        limit = timeout or self.operation_timeout_s
        answer: asyncio.Future[env_pb2.SessionResponse] = asyncio.get_running_loop().create_future()
        waiters = self._waiting.get(request_id)
        if waiters is None:
            self._waiting[request_id] = [answer]
        else:
            waiters.append(answer)
        slots = self._slots
        try:
            async with asyncio.timeout(limit):
                if slots is not None:
                    await slots.acquire()
                try:
                    try:
                        await asyncio.shield(self._send(request))
                    except (grpc.aio.UsageError, asyncio.InvalidStateError):
                        # The stream already ended: its reader is about to say how (bounded).
                        await asyncio.wait({self._reader})
                        raise self.failure or Unavailable("the session stream has ended",
                                                          Reason.SHUTTING_DOWN) from None
                    response = await answer
                finally:
                    if slots is not None:
                        slots.release()
        except TimeoutError:
            raise DeadlineExceeded(f"no answer to {request.WhichOneof('operation')} {request_id} within"
                                   f" {limit:g} s", Reason.STEP_TIMEOUT) from None
        except grpc.aio.AioRpcError as error:
            raise from_rpc_error(error) from None
        finally:
            if answer.done() and not answer.cancelled():
                answer.exception()  # seen: when the write failed, the error was raised from there
            waiters = self._waiting.get(request_id)
            if waiters is not None:
                if len(waiters) == 1:
                    del self._waiting[request_id]
                elif answer in waiters:
                    waiters.remove(answer)
        return response

    def _send(self, request: env_pb2.SessionRequest) -> asyncio.Future[None]:
        """Write `request` in a task of its own. gRPC cancels the whole call when a write on it
        is cancelled, and this stream carries every caller's episodes: a caller that gives up
        mid-write (its timeout, its cancellation) must leave the write, and the others'
        episodes, alone. The task holds the write lock until its write is done (gRPC allows one
        pending write per stream), so writes go out in the order they were sent."""
        write = asyncio.ensure_future(self._write(request))
        write.add_done_callback(_seen)
        return write

    async def _write(self, request: env_pb2.SessionRequest) -> None:
        async with self._write_lock:
            await self._call.write(request)

    async def _read(self) -> None:
        try:
            async for answer in self._call:
                self.received += 1
                result = answer.WhichOneof("result")
                if result == "heartbeat":
                    self.last_heartbeat = answer
                    continue
                # Tracked here, before anything else can run: an episode the server opened is
                # on this stream even if its caller has given up waiting.
                if result == "reset" or result == "fork":
                    self.opened.add(answer.episode_id)
                elif result == "close":
                    self.opened.discard(answer.episode_id)
                waiting = next((w for w in self._waiting.get(answer.request_id, ()) if not w.done()), None)
                if waiting is None:
                    continue  # its caller gave up (timeout, cancellation)
                if result == "error":
                    waiting.set_exception(from_status(answer.error))
                else:
                    waiting.set_result(answer)
            self.failure = Unavailable("the server ended the session stream", Reason.SHUTTING_DOWN)
        except grpc.aio.AioRpcError as error:
            self.failure = from_rpc_error(error)
        except asyncio.CancelledError:
            self.failure = Unavailable("the session was closed", Reason.SHUTTING_DOWN)
            raise
        except Exception as error:  # noqa: BLE001 - e.g. an undecodable answer: the stream is unusable
            self.failure = Internal(f"the session stream failed: {type(error).__name__}: {error}")
        finally:
            failure = self.failure or Unavailable("the session stream failed", Reason.SHUTTING_DOWN)
            self.failure = failure
            for waiters in self._waiting.values():
                for waiting in waiters:
                    if not waiting.done():
                        waiting.set_exception(failure)
            if self._on_end is not None:
                self._on_end(self, failure)

    async def aclose(self) -> None:
        """Half-close the stream, let the server answer what is in flight (bounded), then end it."""
        with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):
            async with asyncio.timeout(SESSION_DRAIN_TIMEOUT_S):
                async with self._write_lock:
                    await self._call.done_writing()
        try:
            await asyncio.wait_for(asyncio.shield(self._reader), SESSION_DRAIN_TIMEOUT_S)
        except (TimeoutError, asyncio.CancelledError):
            self._call.cancel()
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader


def _seen(task: asyncio.Future[None]) -> None:
    """Mark a write's failure seen: a write whose caller gave up fails unawaited, and its
    stream's reader reports why the stream ended."""
    if not task.cancelled():
        task.exception()


__all__ = ["EnvClient", "EnvSession", "close_request", "new_request_id", "reset_request", "step_request",
           "tool_calls_action", "verify_request"]
