"""The end of a Session stream closes its episodes, however the stream is torn down: here the
stream runs in-process on the real service and toy environment, so the test can cancel it at
the exact points gRPC's server does."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator

from env_servers.app import load_sources
from env_servers.config import EnvServerConfig
from env_servers.service import EnvironmentService
from env_servers.session import SessionStream
from sciproto.pb import env_pb2


async def _requests(queue: asyncio.Queue[env_pb2.SessionRequest]) -> AsyncIterator[env_pb2.SessionRequest]:
    while True:
        yield await queue.get()


async def _live_after(service: EnvironmentService, seconds: float) -> int:
    """Open episodes once closing has had `seconds` to finish (or at once when none are left)."""
    deadline = asyncio.get_running_loop().time() + seconds
    while service.registry.live and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    return service.registry.live


async def test_a_stream_cancelled_again_while_it_ends_still_closes_its_episodes() -> None:
    # gRPC's server may cancel a cancelled stream's handler once more while it is ending (seen
    # once in 300 cancelled Sessions on a real server); the episodes must close all the same.
    config = EnvServerConfig(envs=["toy"])
    service = EnvironmentService(config, load_sources(config))
    service.start()
    try:
        queue: asyncio.Queue[env_pb2.SessionRequest] = asyncio.Queue()
        answers: asyncio.Queue[env_pb2.SessionResponse] = asyncio.Queue()

        async def consume() -> None:
            async for answer in SessionStream(service, heartbeat_interval_s=5.0).run(_requests(queue)):
                answers.put_nowait(answer)

        handler = asyncio.ensure_future(consume())
        queue.put_nowait(env_pb2.SessionRequest(reset=env_pb2.ResetRequest(
            request_id=secrets.token_hex(8), env="toy", task_ref=env_pb2.TaskRef(split="train", index=0))))
        opened = await asyncio.wait_for(answers.get(), 30)
        assert opened.reset.episode_id and service.registry.live == 1, opened

        handler.cancel()  # the client cancelled: the stream starts to end ...
        await asyncio.sleep(0)
        handler.cancel()  # ... and is cancelled again before it is done
        await asyncio.gather(handler, return_exceptions=True)

        assert await _live_after(service, 10.0) == 0, "the stream's episode is still open after it ended"
    finally:
        await service.aclose()
