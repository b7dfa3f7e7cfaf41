"""One Session stream: many operations in flight at once, answered as each finishes.

Every request runs in its own task, so a slow step on one episode never holds up the others
(steps on the same episode still queue on that episode's lock). Answers carry the request's
request_id; a failed operation is answered with an in-band google.rpc.Status and the stream goes
on. While operations run longer than the heartbeat interval, the stream sends heartbeats. When
the stream ends (the client half-closes, cancels or disconnects), every episode opened on it and
not yet closed is closed.

Flow control (protocol 1.2): at most `max_in_flight` operations run at once; one sent beyond
that is answered at once with RESOURCE_EXHAUSTED (TOO_MANY_IN_FLIGHT) and a RetryInfo. Answers
wait in a bounded queue: a client that stops reading stops the server reading its frames, and
gRPC's flow control holds back the rest. Every frame is charged to the principal's request rate,
as a unary call is (over it: RATE_LIMITED, in-band). A `cancel` stops one running operation,
which is answered CANCELLED; a step cancelled mid-way fails its episode (see EpisodeRegistry).

The stream as a whole needs the AGENT role (checked before it starts); a verify on it also needs
GRADER, checked per operation, as the unary Verify RPC requires.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import grpc

from sciproto.auth import AuthRole, Principal, charge_request, current_principal, require_role
from sciproto.errors import (
    Cancelled,
    Internal,
    InvalidArgument,
    Reason,
    ResourceExhausted,
    SciprotoError,
    to_status,
)
from sciproto.pb import env_pb2

if TYPE_CHECKING:
    from env_servers.config import EnvServerConfig
    from env_servers.registry import EpisodeRegistry

log = logging.getLogger("env_servers.session")

_ENDING: set[asyncio.Task[None]] = set()  # streams' endings under way (the loop keeps weak references)


class EpisodeOperations(Protocol):
    """What a stream runs its operations on: the unary handlers of
    `env_servers.service.EnvironmentService`, which opens the streams. A protocol, so that this
    module does not import the one that imports it."""

    config: EnvServerConfig
    registry: EpisodeRegistry

    async def reset(self, request: env_pb2.ResetRequest, *, context: grpc.aio.ServicerContext | None = None,
                    detach: bool = True) -> env_pb2.ResetResponse: ...

    async def step(self, request: env_pb2.StepRequest, *, context: grpc.aio.ServicerContext | None = None,
                   detach: bool = True) -> env_pb2.StepResponse: ...

    async def fork(self, request: env_pb2.ForkRequest, *, context: grpc.aio.ServicerContext | None = None,
                   detach: bool = True) -> env_pb2.ForkResponse: ...

    async def verify(self, request: env_pb2.VerifyRequest, *,
                     context: grpc.aio.ServicerContext | None = None) -> env_pb2.VerifyResponse: ...

    async def close(self, request: env_pb2.CloseRequest, *,
                    context: grpc.aio.ServicerContext | None = None) -> env_pb2.CloseResponse: ...


@dataclass
class _Running:
    request_id: str
    episode_id: str
    started: float


class SessionStream:
    def __init__(self, service: EpisodeOperations, heartbeat_interval_s: float,
                 context: grpc.aio.ServicerContext | None = None, max_in_flight: int = 256) -> None:
        self.service = service
        self.context = context
        self.heartbeat_interval_s = heartbeat_interval_s
        self.max_in_flight = max_in_flight
        # Room for every running operation's answer and as many refusals; beyond that the
        # reader waits for the client to read (heartbeats are dropped instead of waiting).
        self._answers: asyncio.Queue[env_pb2.SessionResponse | None] = asyncio.Queue(2 * max_in_flight + 1)
        self._running: dict[asyncio.Task[None], _Running] = {}
        self._by_request_id: dict[str, asyncio.Task[None]] = {}  # running operations, for cancel
        self._cancelled: set[asyncio.Task[None]] = set()  # stopped by the client's cancel
        self._opened: set[str] = set()  # episodes opened here and not closed yet
        self._unreadable: SciprotoError | None = None  # a frame that was not a SessionRequest

    async def run(self, requests: AsyncIterator[env_pb2.SessionRequest]
                  ) -> AsyncIterator[env_pb2.SessionResponse]:
        """The answers to `requests`, until the client has sent its last request and every
        operation has been answered."""
        reader = asyncio.ensure_future(self._read(requests))
        heartbeat = asyncio.ensure_future(self._beat())
        try:
            while (answer := await self._answers.get()) is not None:
                yield answer
            if self._unreadable is not None:
                raise self._unreadable  # the stream ends with its status (INVALID_ARGUMENT)
        finally:
            for task in (reader, heartbeat, *self._running):
                task.cancel()
            # gRPC may cancel the handler again while it ends (about once in 300 cancelled
            # streams): the ending runs in its own task, which a second cancel cannot cut short.
            ending = asyncio.ensure_future(self._end([reader, heartbeat, *self._running]))
            _ENDING.add(ending)
            ending.add_done_callback(_ENDING.discard)
            await asyncio.shield(ending)

    async def _end(self, tasks: list[asyncio.Task[None]]) -> None:
        """Wait for the stream's cancelled tasks, then close the episodes it opened."""
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._opened:
            await self.service.registry.close_all(list(self._opened))

    async def _read(self, requests: AsyncIterator[env_pb2.SessionRequest]) -> None:
        principal = current_principal()
        try:
            async for request in requests:
                refusal = self._admit(request, principal)
                if refusal is not None:
                    await self._answers.put(refusal)
                elif request.WhichOneof("operation") == "cancel":
                    await self._answers.put(self._cancel(request.cancel))
                else:
                    self._start(request)
            if self._running:
                await asyncio.wait(list(self._running))
        except SciprotoError as error:  # an undecodable frame: no request_id to answer in-band
            self._unreadable = error
        except Exception as error:  # the transport broke; the stream ends and cleans up
            log.info("session stream ended while reading: %s", error, exc_info=True)
        # Not in a finally: when the stream is torn down this task is cancelled, and nobody
        # reads the queue any more.
        await self._answers.put(None)

    def _admit(self, request: env_pb2.SessionRequest, principal: Principal | None) -> env_pb2.SessionResponse | None:
        """The in-band refusal of a frame over the principal's rate or beyond max_in_flight."""
        try:
            charge_request(principal)
            if request.WhichOneof("operation") != "cancel" and len(self._running) >= self.max_in_flight:
                raise ResourceExhausted(
                    f"this Session stream has {len(self._running)} operations running, its max_in_flight;"
                    " wait for answers before sending more, or retry after the delay in RetryInfo",
                    Reason.TOO_MANY_IN_FLIGHT, metadata={"max_in_flight": str(self.max_in_flight)},
                    retry_after_s=self.service.config.retry_after_s)
        except SciprotoError as error:
            answer = env_pb2.SessionResponse(request_id=_request_id(request), episode_id=_episode_id(request))
            answer.error.CopyFrom(to_status(error))
            return answer
        return None

    def _start(self, request: env_pb2.SessionRequest) -> None:
        request_id = _request_id(request)
        operation = asyncio.ensure_future(self._answer(request))
        self._running[operation] = _Running(request_id, _episode_id(request), time.monotonic())
        if request_id:
            self._by_request_id[request_id] = operation
        operation.add_done_callback(self._finished)

    def _finished(self, operation: asyncio.Task[None]) -> None:
        running = self._running.pop(operation)
        if self._by_request_id.get(running.request_id) is operation:
            del self._by_request_id[running.request_id]
        self._cancelled.discard(operation)

    def _cancel(self, cancel: env_pb2.CancelRequest) -> env_pb2.SessionResponse:
        """Stop the running operation `cancel` names; its own answer says CANCELLED."""
        operation = self._by_request_id.get(cancel.target_request_id)
        stopped = operation is not None and not operation.done()
        if stopped:
            assert operation is not None
            self._cancelled.add(operation)
            operation.cancel()
        episode_id = self._running[operation].episode_id if stopped and operation in self._running else ""
        return env_pb2.SessionResponse(request_id=cancel.request_id, episode_id=episode_id,
                                       cancel=env_pb2.CancelResponse(cancelled=stopped))

    async def _answer(self, request: env_pb2.SessionRequest) -> None:
        answer = env_pb2.SessionResponse(request_id=_request_id(request), episode_id=_episode_id(request))
        try:
            await self._apply(request, answer)
        except asyncio.CancelledError:
            if asyncio.current_task() not in self._cancelled:
                raise  # the stream is ending
            operation = request.WhichOneof("operation")
            answer.ClearField("result")
            answer.error.CopyFrom(to_status(Cancelled(
                f"the {operation} was cancelled by the client's cancel before it finished"
                + ("; its episode has ended (Verify reports INFRA_ERROR)" if operation == "step" else ""),
                Reason.CANCELLED)))
        except SciprotoError as error:
            answer.error.CopyFrom(to_status(error))
        except Exception as error:  # a bug: answer it, keep the stream
            operation = f"Session.{request.WhichOneof('operation')}"
            log.exception("unexpected error in %s", operation)
            answer.error.CopyFrom(to_status(_internal_error(error, operation)))
        await self._answers.put(answer)

    async def _apply(self, request: env_pb2.SessionRequest, answer: env_pb2.SessionResponse) -> None:
        service, context = self.service, self.context
        operation = request.WhichOneof("operation")
        if operation == "step":
            answer.step.CopyFrom(await service.step(request.step, context=context, detach=False))
        elif operation == "reset":
            reset = await service.reset(request.reset, context=context, detach=False)
            self._opened.add(reset.episode_id)
            answer.episode_id = reset.episode_id
            answer.reset.CopyFrom(reset)
        elif operation == "fork":
            fork = await service.fork(request.fork, context=context, detach=False)
            self._opened.add(fork.episode_id)
            answer.episode_id = fork.episode_id
            answer.fork.CopyFrom(fork)
        elif operation == "verify":
            require_role(AuthRole.GRADER)
            answer.verify.CopyFrom(await service.verify(request.verify, context=context))
        elif operation == "close":
            answer.close.CopyFrom(await service.close(request.close, context=context))
            self._opened.discard(request.close.episode_id)
        else:
            raise InvalidArgument("SessionRequest carries no operation: set reset, step, fork, verify, close or cancel",
                                  Reason.INVALID_REQUEST)

    async def _beat(self) -> None:
        """Tell the client which operations are still running, every heartbeat interval."""
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            now = time.monotonic()
            for running in list(self._running.values()):
                elapsed = now - running.started
                if elapsed >= self.heartbeat_interval_s and not self._answers.full():
                    self._answers.put_nowait(env_pb2.SessionResponse(
                        request_id=running.request_id, episode_id=running.episode_id,
                        heartbeat=env_pb2.SessionHeartbeat(elapsed_seconds=elapsed)))


def _request_id(request: env_pb2.SessionRequest) -> str:
    operation = request.WhichOneof("operation")
    return getattr(request, operation).request_id if operation else ""



def _episode_id(request: env_pb2.SessionRequest) -> str:
    operation = request.WhichOneof("operation")
    if operation in ("step", "close", "fork"):
        return getattr(request, operation).episode_id
    if operation == "verify":
        return request.verify.episode_id
    return ""


def _internal_error(error: Exception, operation: str) -> SciprotoError:
    """What the client gets for a bug, as the unary error interceptor would say it (the
    traceback stays in the server's log)."""
    return Internal(f"internal error in {operation}: {type(error).__name__}: {error}; the server"
                    " logged the traceback")
