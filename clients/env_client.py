"""Async client of EnvironmentService.

    async with EnvClient("127.0.0.1:50051") as env:
        reset = await env.reset("gsm8k", split="test", index=0)
        step = await env.step(reset.episode_id, tool_calls_action(("calculator", {"expr": "6*7"})))
        async with env.session() as session:          # many episodes on one stream
            a, b = await asyncio.gather(session.reset("toy", split="train", index=0),
                                        session.reset("toy", split="train", index=1))

Every call carries a request_id (fresh unless the caller passes one to retry an operation), so
gRPC's own retries (on UNAVAILABLE) never apply an operation twice, and the current span in its
trace_context, so the server's spans join the caller's trace even when many episodes share one
Session stream. Failures are raised as `sciproto.errors.SciprotoError` subclasses, whose
`reason` says what happened, on unary calls and on the stream alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any, Self

import grpc

from sciproto.channel import ChannelConfig, make_channel
from sciproto.errors import (
    DeadlineExceeded,
    Reason,
    SciprotoError,
    Unavailable,
    from_rpc_error,
    from_status,
)
from sciproto.pb import common_pb2, env_grpc, env_pb2
from sciproto.tracing import current_trace_context

# How long leaving a session waits for the server to answer what is still in flight.
SESSION_DRAIN_TIMEOUT_S = 10.0


def new_request_id() -> str:
    return uuid.uuid4().hex


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
    """Unary calls, and `session()` for a Session stream, on one channel."""

    def __init__(self, channel_or_config: grpc.aio.Channel | ChannelConfig | str) -> None:
        if isinstance(channel_or_config, (ChannelConfig, str)):
            self._channel, self._owns_channel = make_channel(channel_or_config), True
        else:
            self._channel, self._owns_channel = channel_or_config, False
        self._stub = env_grpc.EnvironmentServiceStub(self._channel)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the channel if this client made it."""
        if self._owns_channel:
            await self._channel.close()

    async def _call(self, method: Any, request: Any, timeout: float | None) -> Any:
        try:
            return await method(request, timeout=timeout)
        except grpc.aio.AioRpcError as error:
            raise from_rpc_error(error) from None

    async def describe(self, timeout: float | None = None) -> env_pb2.EnvironmentServiceDescribeResponse:
        request = env_pb2.EnvironmentServiceDescribeRequest(request_id=new_request_id(),
                                                            trace_context=current_trace_context())
        return await self._call(self._stub.Describe, request, timeout)

    async def reset(self, env: str, *, split: str | None = None, index: int | None = None,
                    inline: Mapping[str, str] | None = None, seed: int | None = None,
                    request_id: str | None = None, timeout: float | None = None,
                    options: Mapping[str, str] | None = None) -> env_pb2.ResetResponse:
        request = reset_request(env, split=split, index=index, inline=inline, seed=seed, request_id=request_id,
                                options=options)
        return await self._call(self._stub.Reset, request, timeout)

    async def step(self, episode_id: str, action: common_pb2.ChatMessage, *, request_id: str | None = None,
                   timeout: float | None = None) -> env_pb2.StepResponse:
        """Pass the same request_id to retry a step safely: the server answers with the first result."""
        return await self._call(self._stub.Step, step_request(episode_id, action, request_id), timeout)

    async def verify(self, episode_id: str | None = None, *, trajectory: env_pb2.StoredTrajectory | None = None,
                     request_id: str | None = None, timeout: float | None = None) -> env_pb2.VerifyResponse:
        request = verify_request(episode_id, trajectory=trajectory, request_id=request_id)
        return await self._call(self._stub.Verify, request, timeout)

    async def fork(self, episode_id: str, *, request_id: str | None = None,
                   timeout: float | None = None) -> env_pb2.ForkResponse:
        """A new episode copied from `episode_id` at its current step; close it like any episode.
        Pass the same request_id to retry: the server answers with the same fork."""
        return await self._call(self._stub.Fork, fork_request(episode_id, request_id), timeout)

    async def close(self, episode_id: str, *, request_id: str | None = None,
                    timeout: float | None = None) -> env_pb2.CloseResponse:
        return await self._call(self._stub.Close, close_request(episode_id, request_id), timeout)

    @contextlib.asynccontextmanager
    async def session(self, operation_timeout_s: float = 300.0) -> AsyncIterator[EnvSession]:
        """A Session stream for the duration of the block. Leaving the block ends the stream, and
        the server closes every episode opened on it."""
        session = EnvSession(self._stub.Session(), operation_timeout_s)
        try:
            yield session
        finally:
            await session.aclose()


class EnvSession:
    """Operations on one Session stream, each an awaitable matched to its answer by request_id.
    Operations may run concurrently; heartbeats are absorbed here."""

    def __init__(self, call: grpc.aio.StreamStreamCall, operation_timeout_s: float) -> None:
        self._call = call
        self.operation_timeout_s = operation_timeout_s
        self.last_heartbeat: env_pb2.SessionResponse | None = None
        self._waiting: dict[str, asyncio.Future[env_pb2.SessionResponse]] = {}
        self._write_lock = asyncio.Lock()  # gRPC allows one pending write per stream
        self._failure: SciprotoError | None = None
        self._reader = asyncio.ensure_future(self._read())

    async def reset(self, env: str, *, split: str | None = None, index: int | None = None,
                    inline: Mapping[str, str] | None = None, seed: int | None = None,
                    request_id: str | None = None, timeout: float | None = None,
                    options: Mapping[str, str] | None = None) -> env_pb2.ResetResponse:
        request = reset_request(env, split=split, index=index, inline=inline, seed=seed, request_id=request_id,
                                options=options)
        answer = await self._run(env_pb2.SessionRequest(reset=request), request.request_id, timeout)
        return answer.reset

    async def step(self, episode_id: str, action: common_pb2.ChatMessage, *, request_id: str | None = None,
                   timeout: float | None = None) -> env_pb2.StepResponse:
        request = step_request(episode_id, action, request_id)
        return (await self._run(env_pb2.SessionRequest(step=request), request.request_id, timeout)).step

    async def verify(self, episode_id: str | None = None, *, trajectory: env_pb2.StoredTrajectory | None = None,
                     request_id: str | None = None, timeout: float | None = None) -> env_pb2.VerifyResponse:
        request = verify_request(episode_id, trajectory=trajectory, request_id=request_id)
        return (await self._run(env_pb2.SessionRequest(verify=request), request.request_id, timeout)).verify

    async def fork(self, episode_id: str, *, request_id: str | None = None,
                   timeout: float | None = None) -> env_pb2.ForkResponse:
        """As EnvClient.fork, on this stream: the fork is closed with the stream at the latest."""
        request = fork_request(episode_id, request_id)
        return (await self._run(env_pb2.SessionRequest(fork=request), request.request_id, timeout)).fork

    async def close(self, episode_id: str, *, request_id: str | None = None,
                    timeout: float | None = None) -> env_pb2.CloseResponse:
        request = close_request(episode_id, request_id)
        return (await self._run(env_pb2.SessionRequest(close=request), request.request_id, timeout)).close

    async def _run(self, request: env_pb2.SessionRequest, request_id: str,
                   timeout: float | None) -> env_pb2.SessionResponse:
        if self._failure is not None:
            raise self._failure
        if request_id in self._waiting:
            raise ValueError(f"request_id {request_id!r} is already in flight on this session")
        answer = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = answer
        try:
            async with self._write_lock:
                await self._call.write(request)
            async with asyncio.timeout(timeout or self.operation_timeout_s):
                return await answer
        except TimeoutError:
            raise DeadlineExceeded(f"no answer to {request.WhichOneof('operation')} {request_id} within"
                                   f" {timeout or self.operation_timeout_s:g} s", Reason.STEP_TIMEOUT) from None
        except grpc.aio.AioRpcError as error:
            raise from_rpc_error(error) from None
        except grpc.aio.UsageError:  # the stream already ended
            raise self._failure or Unavailable("the session stream has ended", Reason.SHUTTING_DOWN) from None
        finally:
            self._waiting.pop(request_id, None)

    async def _read(self) -> None:
        try:
            async for answer in self._call:
                if answer.WhichOneof("result") == "heartbeat":
                    self.last_heartbeat = answer
                    continue
                waiting = self._waiting.get(answer.request_id)
                if waiting is None or waiting.done():
                    continue  # its caller gave up (timeout, cancellation)
                if answer.WhichOneof("result") == "error":
                    waiting.set_exception(from_status(answer.error))
                else:
                    waiting.set_result(answer)
            self._failure = Unavailable("the server ended the session stream", Reason.SHUTTING_DOWN)
        except grpc.aio.AioRpcError as error:
            self._failure = from_rpc_error(error)
        except asyncio.CancelledError:
            self._failure = Unavailable("the session was closed", Reason.SHUTTING_DOWN)
            raise
        finally:
            failure = self._failure or Unavailable("the session stream failed", Reason.SHUTTING_DOWN)
            for waiting in self._waiting.values():
                if not waiting.done():
                    waiting.set_exception(failure)

    async def aclose(self) -> None:
        """Half-close the stream, let the server answer what is in flight (bounded), then end it."""
        with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):
            async with self._write_lock:
                await self._call.done_writing()
        try:
            await asyncio.wait_for(asyncio.shield(self._reader), SESSION_DRAIN_TIMEOUT_S)
        except (TimeoutError, asyncio.CancelledError):
            self._call.cancel()
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader


__all__ = ["EnvClient", "EnvSession", "close_request", "new_request_id", "reset_request", "step_request",
           "tool_calls_action", "verify_request"]
