"""A replica that comes back at another address (an engine restarted its server on another node
or port): the pool's probe asks `resolve` where it listens now and puts it back in rotation there."""

from __future__ import annotations

import asyncio

import pytest

from clients.agent import env_pool
from sciproto.processes import start_server

pytestmark = pytest.mark.timeout(180)

ENV_ARGS = ["serve", "env", "--env", "toy", "--port", "0"]


async def test_a_replica_restarted_at_a_new_address_rejoins_the_rotation_there() -> None:
    first = start_server(ENV_ARGS)
    second = None
    try:
        where = {0: first.target}
        async with env_pool([first.target], resolve=where.get, probe_max_interval_s=0.5) as pool:
            async with pool.lease() as replica:
                reset = await replica.client.reset("toy", split="train", index=0, timeout=30)
                assert reset.episode_id
            first.stop()
            second = start_server(ENV_ARGS)
            assert second.target != first.target
            where[0] = second.target
            pool.mark_down(replica, RuntimeError("its server went away"))
            assert not pool.healthy()
            async with asyncio.timeout(60):
                async with pool.lease() as back:  # waits for the probe to find it at its new address
                    assert back is replica and back.target == second.target
                    again = await back.client.reset("toy", split="train", index=1, timeout=30)
                    assert again.episode_id and (await back.client.close(again.episode_id)).closed
            assert pool.targets == [second.target]
    finally:
        first.stop()
        if second is not None:
            second.stop()
