"""The idempotency cache on its own: one run per request_id, and expiry once unused."""

from __future__ import annotations

import asyncio

from env_servers.idempotency import IdempotencyCache


async def test_retry_gets_the_first_result_and_entries_expire_when_unused() -> None:
    cache = IdempotencyCache(size=8, ttl_s=0.2)
    calls = 0

    async def step() -> int:
        nonlocal calls
        calls += 1
        return calls

    assert await cache.run("step", "r1", "same", step) == 1
    assert await cache.run("step", "r1", "same", step) == 1  # a retry: not run again
    assert (calls, len(cache)) == (1, 1)
    await asyncio.sleep(0.5)  # the expiry timer (0.2 s) comes due before this wake-up
    assert len(cache) == 0
    assert await cache.run("step", "r1", "same", step) == 2


async def test_size_bound_drops_least_recently_used() -> None:
    cache = IdempotencyCache(size=2, ttl_s=60)

    async def value(v: int) -> int:
        return v

    for index in range(3):
        await cache.run("step", f"r{index}", index, lambda index=index: value(index))
    assert len(cache) == 2
    assert await cache.run("step", "r0", 0, lambda: value(99)) == 99  # r0 was dropped: runs again
