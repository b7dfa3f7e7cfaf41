"""Scale-out over several replicas of one service.

    pool = ReplicaPool(["10.0.0.1:50051", "10.0.0.2:50051"], EnvClient, pb.ENV_SERVICE)
    async with pool.lease() as replica:      # least-loaded healthy replica, held while in use
        await replica.client.reset(...)
        ...                                   # an episode stays on the replica that holds it
    pool.mark_down(replica, error)            # out of rotation until grpc.health.v1 says SERVING

A replica marked down is probed in the background (grpc.health.v1 Check on a fresh connection,
so the probe sees a restarted server at once instead of waiting out the main channel's reconnect
backoff) with an interval that doubles up to `probe_max_interval_s`; when it answers SERVING it
rejoins the rotation, on a new channel if its old one is still failing. With `resolve`, each probe
first asks where the replica listens now (a server that an engine restarted on another node or
port, e.g. a Ray actor), and a replica that moved rejoins on a channel to its new address.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sciproto.channel import ChannelConfig, make_channel
from sciproto.errors import Reason, Unavailable

log = logging.getLogger(__name__)

ClientT = TypeVar("ClientT")


@dataclass(eq=False)
class Replica(Generic[ClientT]):
    """One server: its client, how many leases it holds now, whether it is in rotation."""

    config: ChannelConfig
    channel: grpc.aio.Channel
    client: ClientT
    load: int = 0
    healthy: bool = True
    failures: int = 0  # times it was taken out of rotation
    last_error: str = ""  # why it was last taken out of rotation
    probe: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def target(self) -> str:
        return self.config.target


class ReplicaPool(Generic[ClientT]):
    """Clients of several replicas of `service`, handed out least-loaded first."""

    def __init__(
        self,
        targets: Sequence[str | ChannelConfig],
        make_client: Callable[[grpc.aio.Channel], ClientT],
        service: str,
        *,
        probe_interval_s: float = 0.5,
        probe_max_interval_s: float = 5.0,
        probe_timeout_s: float = 2.0,
        wait_for_healthy_s: float = 30.0,
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
        bare_streams: bool = False,
        resolve: Callable[[int], str | None] | None = None,
    ) -> None:
        if not targets:
            raise ValueError(f"give at least one {service} address (HOST:PORT)")
        configs = [ChannelConfig(target=t) if isinstance(t, str) else t for t in targets]
        self.service = service
        self._make_client = make_client
        self._interceptors = list(interceptors)
        self._bare_streams = bare_streams  # as for make_channel
        # Where replica i (in `targets` order) listens now, or None when unknown; called from a
        # worker thread (it may block briefly). None: replicas never move.
        self._resolve = resolve
        self.replicas: list[Replica[ClientT]] = [self._connect(config) for config in configs]
        self.probe_interval_s = probe_interval_s
        self.probe_max_interval_s = probe_max_interval_s
        self.probe_timeout_s = probe_timeout_s
        self.wait_for_healthy_s = wait_for_healthy_s
        self._turn = itertools.count()  # breaks load ties round-robin
        self._changed = asyncio.Condition()

    def _connect(self, config: ChannelConfig) -> Replica[ClientT]:
        channel = make_channel(config, self._interceptors, bare_streams=self._bare_streams)
        return Replica(config=config, channel=channel, client=self._make_client(channel))

    @property
    def targets(self) -> list[str]:
        return [replica.target for replica in self.replicas]

    def healthy(self) -> list[Replica[ClientT]]:
        return [replica for replica in self.replicas if replica.healthy]

    def _pick(self, exclude: frozenset[Replica[ClientT]]) -> Replica[ClientT] | None:
        candidates = [r for r in self.healthy() if r not in exclude] or self.healthy()
        if not candidates:
            return None
        start = next(self._turn) % len(candidates)
        rotated = candidates[start:] + candidates[:start]
        return min(rotated, key=lambda replica: replica.load)

    async def acquire(self, exclude: frozenset[Replica[ClientT]] = frozenset()) -> Replica[ClientT]:
        """The least-loaded healthy replica (preferring ones not in `exclude`), its load counted
        until `release`. Waits up to `wait_for_healthy_s` for one to come back when all are down."""
        replica = self._pick(exclude)
        if replica is not None:  # the usual case: nothing to wait for
            replica.load += 1
            return replica
        async with self._changed:
            try:
                async with asyncio.timeout(self.wait_for_healthy_s):
                    await self._changed.wait_for(lambda: bool(self.healthy()))
            except TimeoutError:
                why = "; ".join(f"{r.target}: {r.last_error or 'not serving'}" for r in self.replicas)
                raise Unavailable(
                    f"no {self.service} replica answered within {self.wait_for_healthy_s:g} s ({why});"
                    " start one or check the addresses", Reason.NO_HEALTHY_REPLICA) from None
            replica = self._pick(exclude)
            assert replica is not None  # wait_for guaranteed a healthy one
            replica.load += 1
            return replica

    def release(self, replica: Replica[ClientT]) -> None:
        replica.load -= 1

    @contextlib.asynccontextmanager
    async def lease(self, exclude: frozenset[Replica[ClientT]] = frozenset()) -> AsyncIterator[Replica[ClientT]]:
        replica = await self.acquire(exclude)
        try:
            yield replica
        finally:
            self.release(replica)

    def mark_down(self, replica: Replica[ClientT], error: BaseException) -> None:
        """Take `replica` out of rotation and probe it until it is healthy again."""
        if not replica.healthy:
            return
        replica.healthy = False
        replica.failures += 1
        replica.last_error = str(error)
        log.warning("%s replica %s taken out of rotation: %s", self.service, replica.target, error)
        replica.probe = asyncio.create_task(self._probe_until_healthy(replica),
                                            name=f"probe {replica.target}")

    async def _moved(self, replica: Replica[ClientT]) -> bool:
        """Ask `resolve` where `replica` listens now; True when that is a new address."""
        if self._resolve is None:
            return False
        try:
            target = await asyncio.to_thread(self._resolve, self.replicas.index(replica))
        except Exception as error:  # noqa: BLE001 - the probe goes on at the address it has
            log.warning("%s replica %s: could not ask where it listens now: %s", self.service, replica.target, error)
            return False
        if not target or target == replica.target:
            return False
        log.warning("%s replica %s moved to %s", self.service, replica.target, target)
        replica.config = replica.config.model_copy(update={"target": target})
        return True

    async def _probe_until_healthy(self, replica: Replica[ClientT]) -> None:
        interval = self.probe_interval_s
        moved = await self._moved(replica)
        while not await self._serving(replica.config):
            await asyncio.sleep(interval)
            interval = min(interval * 2, self.probe_max_interval_s)
            moved = await self._moved(replica) or moved
        if moved or replica.channel.get_state() != grpc.ChannelConnectivity.READY:
            # The old channel may sit in reconnect backoff for a long time: start afresh. Nothing
            # runs on it (calls on a failing channel fail at once), so closing it loses nothing.
            old = replica.channel
            fresh = self._connect(replica.config)
            replica.channel, replica.client = fresh.channel, fresh.client
            await old.close()
        async with self._changed:
            replica.healthy = True
            replica.probe = None
            self._changed.notify_all()
        log.info("%s replica %s is back in rotation", self.service, replica.target)

    async def _serving(self, config: ChannelConfig) -> bool:
        probe_config = config.model_copy(update={"max_attempts": 1, "default_timeout_s": self.probe_timeout_s})
        async with make_channel(probe_config) as channel:
            try:
                response = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=self.service), timeout=self.probe_timeout_s)
            except grpc.RpcError:
                return False
        return response.status == health_pb2.HealthCheckResponse.SERVING

    async def aclose(self) -> None:
        """Stop the probes, let each client end what it holds open (an EnvClient ends its Session
        stream, and the server closes the stream's episodes before it ends: closing the channel
        first would cancel the stream and leave that cleanup to race the caller's next call), then
        close the channels."""
        probes = [replica.probe for replica in self.replicas if replica.probe is not None]
        for probe in probes:
            probe.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
        endings = [end() for replica in self.replicas if (end := getattr(replica.client, "aclose", None)) is not None]
        await asyncio.gather(*endings)
        await asyncio.gather(*(replica.channel.close() for replica in self.replicas))

    async def __aenter__(self) -> ReplicaPool[ClientT]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
