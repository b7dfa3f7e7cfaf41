"""The run's TrainStep stream to the learner, kept open across learner restarts.

Every group sent stays in the ledger (`clients.train.flow.GroupLedger`) until the learner settles
it. Before its first stream the learner's Describe must report this client's major protocol
version (`sciproto.client.protocol`). A stream broken with one of `RECONNECT_CODES` is opened again, with a backoff of 0.5 s doubling
to 5 s, for at most `reconnect_s` of the learner being unreachable; each new stream sends every
unsettled group first, then new ones. A group the learner had no room for is sent again after
`BUSY_RESEND_S`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from clients.train.display import RunStatus
from clients.train.flow import GroupLedger
from sciproto.channel import make_channel
from sciproto.client.protocol import check_protocol
from sciproto.errors import Unavailable
from sciproto.pb import learner_grpc, learner_pb2

log = logging.getLogger(__name__)

# A broken TrainStep stream with one of these codes is opened again (the learner restarts).
RECONNECT_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
                   grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED)
BUSY_RESEND_S = 1.0  # wait before sending again a group the learner had no room for
DESCRIBE_TIMEOUT_S = 30.0

Handler = Callable[[learner_pb2.TrainStepResponse], Awaitable[None]]


class LearnerStream:
    """Groups out, events in: `send` queues a group (and puts it in the ledger), `run` streams
    until cancelled and hands every event to `handle`."""

    def __init__(self, target: str, ledger: GroupLedger, status: RunStatus, reconnect_s: float) -> None:
        self.target = target
        self.ledger = ledger
        self.status = status
        self.reconnect_s = reconnect_s
        self.reconnects = 0
        self._outgoing: asyncio.Queue[learner_pb2.TrainStepRequest] = asyncio.Queue()
        self._later: set[asyncio.Future[None]] = set()

    def send(self, request: learner_pb2.TrainStepRequest) -> None:
        self.ledger.add(request)
        self._outgoing.put_nowait(request)

    def send_again_later(self, group_id: str) -> None:
        """A group refused for lack of room: send it again after BUSY_RESEND_S, if still unsettled."""

        async def later() -> None:
            await asyncio.sleep(BUSY_RESEND_S)
            if group_id in self.ledger.unsettled:
                self._outgoing.put_nowait(self.ledger.unsettled[group_id])

        task = asyncio.ensure_future(later())
        self._later.add(task)
        task.add_done_callback(self._later.discard)

    async def _requests(self) -> AsyncIterator[learner_pb2.TrainStepRequest]:
        """One stream's messages: every unsettled group first, then new ones."""
        while not self._outgoing.empty():
            self._outgoing.get_nowait()  # each is in the ledger, and sent below
        for request in self.ledger.to_resend():
            yield request
        while True:
            request = await self._outgoing.get()
            if request.group.group_id in self.ledger.unsettled:
                self.ledger.sent.add(request.group.group_id)
                yield request

    async def run(self, handle: Handler) -> None:
        """TrainStep, opened again while the learner restarts (bounded by reconnect_s)."""
        status = self.status
        channel = make_channel(self.target)
        try:
            stub = learner_grpc.LearnerServiceStub(channel)
            backoff = 0.5
            checked = False
            while True:
                try:
                    if not checked:
                        described = await stub.Describe(learner_pb2.LearnerServiceDescribeRequest(),
                                                        timeout=DESCRIBE_TIMEOUT_S)
                        check_protocol(described.server, "learner", self.target)
                        checked = True
                    call = stub.TrainStep(self._requests())
                    try:
                        async for event in call:
                            if status.learner_down_since is not None:
                                log.warning("learner reachable again; unsettled groups were sent again")
                            status.learner_down_since, backoff = None, 0.5
                            await handle(event)
                        error_text = "the learner ended the stream"
                    finally:
                        call.cancel()
                except grpc.RpcError as error:
                    if error.code() not in RECONNECT_CODES:
                        raise
                    error_text = f"{error.code().name}: {error.details()}"
                now = time.monotonic()
                if status.learner_down_since is None:
                    status.learner_down_since = now
                    self.reconnects += 1
                    log.warning("learner stream broke (%s); reconnecting", error_text)
                elif now - status.learner_down_since > self.reconnect_s:
                    raise Unavailable(
                        f"the learner at {self.target} stayed unreachable for "
                        f"{self.reconnect_s:.0f} s ({error_text}); see learner.log"
                    )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
        finally:
            for task in self._later:
                task.cancel()
            await asyncio.gather(*self._later, return_exceptions=True)
            await channel.close()


__all__ = ["BUSY_RESEND_S", "DESCRIBE_TIMEOUT_S", "RECONNECT_CODES", "LearnerStream"]
