"""Staleness control, signal filtering and backpressure of the rollout buffer."""

from __future__ import annotations

import asyncio
import random

import pytest
from learner_fixtures import make_group

from learner.buffer import RolloutBuffer
from learner.types import RewardStatus


async def test_stale_groups_are_dropped_and_counted(rng: random.Random) -> None:
    buffer = RolloutBuffer(capacity=8, max_staleness=1)
    for version in (3, 4, 5, 5):
        await buffer.add(make_group(rng, [1.0, 0.0], group_id=f"v{version}", version=version))
    taken = await buffer.take(3, current_version=5, timeout=1)
    # Version 3 is 2 behind version 5 (> K = 1): dropped; 4 (lag 1) and 5 (lag 0) train.
    assert [g.group_id for g in taken] == ["v4", "v5", "v5"]
    assert buffer.counters.dropped_stale == 1
    assert buffer.counters.last_policy_lag_max == 1
    assert 0 < buffer.counters.last_policy_lag_mean < 1


async def test_zero_staleness_is_on_policy(rng: random.Random) -> None:
    buffer = RolloutBuffer(capacity=8, max_staleness=0)
    group = make_group(rng, [1.0, 0.0], version=2)
    # A group whose tokens mix versions is as old as its oldest trained token.
    group.samples[0].policy_versions[-1] = 1
    await buffer.add(group)
    await buffer.add(make_group(rng, [1.0, 0.0], group_id="fresh", version=2))
    taken = await buffer.take(1, current_version=2, timeout=1)
    assert [g.group_id for g in taken] == ["fresh"]
    assert buffer.counters.dropped_stale == 1
    assert buffer.counters.last_policy_lag_max == 0


async def test_groups_without_signal_never_enter(rng: random.Random) -> None:
    buffer = RolloutBuffer(capacity=8, max_staleness=1)
    assert not await buffer.add(make_group(rng, [0.5, 0.5, 0.5]))
    infra = [RewardStatus.SCORED, RewardStatus.INFRA_ERROR, RewardStatus.INFRA_ERROR]
    assert not await buffer.add(make_group(rng, [1.0, 0.0, 0.0], statuses=infra))
    assert await buffer.add(make_group(rng, [1.0, 0.0, 0.0], statuses=infra[:2] + infra[:1]))
    assert len(buffer) == 1
    c = buffer.counters
    assert (c.groups_received, c.dropped_all_equal, c.infra_errors) == (3, 2, 3)


async def test_full_buffer_applies_backpressure(rng: random.Random) -> None:
    buffer = RolloutBuffer(capacity=2, max_staleness=4)
    for _ in range(2):
        await buffer.add(make_group(rng, [1.0, 0.0]))
    with pytest.raises(TimeoutError):
        await buffer.add(make_group(rng, [1.0, 0.0]), timeout=0.05)

    # A waiting producer proceeds as soon as the trainer takes groups out.
    producer = asyncio.create_task(buffer.add(make_group(rng, [1.0, 0.0], group_id="late")))
    await asyncio.sleep(0)
    assert not producer.done()
    await buffer.take(2, current_version=0, timeout=1)
    assert await asyncio.wait_for(producer, timeout=5)
    assert [g.group_id for g in await buffer.take(1, current_version=0, timeout=1)] == ["late"]


async def test_take_waits_for_producers_and_times_out_without_losing_groups(
    rng: random.Random,
) -> None:
    buffer = RolloutBuffer(capacity=1, max_staleness=0)

    async def produce() -> None:
        for i in range(3):
            await buffer.add(make_group(rng, [1.0, 0.0], group_id=str(i)), timeout=5)

    # More groups than the capacity: the taker frees slots while it waits.
    producer = asyncio.create_task(produce())
    taken = await buffer.take(3, current_version=0, timeout=5)
    await producer
    assert [g.group_id for g in taken] == ["0", "1", "2"]

    await buffer.add(make_group(rng, [1.0, 0.0], group_id="kept"))
    with pytest.raises(TimeoutError):
        await buffer.take(2, current_version=0, timeout=0.05)
    assert [g.group_id for g in await buffer.take(1, current_version=0, timeout=1)] == ["kept"]
