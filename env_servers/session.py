"""One Session stream: many operations in flight at once, answered as each finishes.

Every request runs in its own task, so a slow step on one episode never holds up the others
(steps on the same episode still queue on that episode's lock). Answers carry the request's
request_id; a failed operation is answered with an in-band google.rpc.Status and the stream goes
on. While operations run longer than the heartbeat interval, the stream sends heartbeats. When
the stream ends (the client half-closes, cancels or disconnects), every episode opened on it and
not yet closed is closed.

The stream as a whole needs the AGENT role (checked before it starts); a verify on it also needs
GRADER, checked per operation, as the unary Verify RPC requires.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from sciproto.auth import AuthRole, require_role
from sciproto.errors import Internal, InvalidArgument, Reason, SciprotoError, to_status
from sciproto.pb import env_pb2

if TYPE_CHECKING:
    from env_servers.service import EnvironmentService

log = logging.getLogger("env_servers.session")


@dataclass
class _Running:
    request_id: str
    episode_id: str
    started: float


class SessionStream:
    def __init__(self, service: EnvironmentService, heartbeat_interval_s: float,
                 context: grpc.aio.ServicerContext | None = None) -> None:
        self.service = service
        self.context = context
        self.heartbeat_interval_s = heartbeat_interval_s
        self._answers: asyncio.Queue[env_pb2.SessionResponse | None] = asyncio.Queue()
        self._running: dict[asyncio.Task[None], _Running] = {}
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
            await asyncio.gather(reader, heartbeat, *self._running, return_exceptions=True)
            if self._opened:
                await self.service.registry.close_all(list(self._opened))

    async def _read(self, requests: AsyncIterator[env_pb2.SessionRequest]) -> None:
        try:
            async for request in requests:
                operation = asyncio.ensure_future(self._answer(request))
                self._running[operation] = _Running(_request_id(request), _episode_id(request),
                                                    time.monotonic())
                operation.add_done_callback(self._running.pop)
            if self._running:
                await asyncio.wait(list(self._running))
        except SciprotoError as error:  # an undecodable frame: no request_id to answer in-band
            self._unreadable = error
        except Exception as error:  # the transport broke; the stream ends and cleans up
            log.info("session stream ended while reading: %s", error, exc_info=True)
        finally:
            self._answers.put_nowait(None)

    async def _answer(self, request: env_pb2.SessionRequest) -> None:
        answer = env_pb2.SessionResponse(request_id=_request_id(request), episode_id=_episode_id(request))
        try:
            await self._apply(request, answer)
        except SciprotoError as error:
            answer.error.CopyFrom(to_status(error))
        except Exception as error:  # a bug: answer it, keep the stream
            operation = f"Session.{request.WhichOneof('operation')}"
            log.exception("unexpected error in %s", operation)
            answer.error.CopyFrom(to_status(_internal_error(error, operation)))
        self._answers.put_nowait(answer)

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
        elif operation == "verify":
            require_role(AuthRole.GRADER)
            answer.verify.CopyFrom(await service.verify(request.verify, context=context))
        elif operation == "close":
            answer.close.CopyFrom(await service.close(request.close, context=context))
            self._opened.discard(request.close.episode_id)
        else:
            raise InvalidArgument("SessionRequest carries no operation: set reset, step, verify or close",
                                  Reason.INVALID_REQUEST)

    async def _beat(self) -> None:
        """Tell the client which operations are still running, every heartbeat interval."""
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            now = time.monotonic()
            for running in list(self._running.values()):
                elapsed = now - running.started
                if elapsed >= self.heartbeat_interval_s:
                    self._answers.put_nowait(env_pb2.SessionResponse(
                        request_id=running.request_id, episode_id=running.episode_id,
                        heartbeat=env_pb2.SessionHeartbeat(elapsed_seconds=elapsed)))


def _request_id(request: env_pb2.SessionRequest) -> str:
    operation = request.WhichOneof("operation")
    return getattr(request, operation).request_id if operation else ""


def _episode_id(request: env_pb2.SessionRequest) -> str:
    operation = request.WhichOneof("operation")
    if operation in ("step", "close"):
        return getattr(request, operation).episode_id
    if operation == "verify":
        return request.verify.episode_id
    return ""


def _internal_error(error: Exception, operation: str) -> SciprotoError:
    """What the client gets for a bug, as the unary error interceptor would say it (the
    traceback stays in the server's log)."""
    return Internal(f"internal error in {operation}: {type(error).__name__}: {error}; the server"
                    " logged the traceback")
