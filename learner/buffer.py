"""Rollout buffer between the rollout clients and the trainer, with staleness control.

Staleness of a group = current_version - (oldest policy version among its trained tokens).
A group more than `max_staleness` versions behind is dropped when taken (K = 0: only groups
sampled entirely by the current policy train, i.e. synchronous on-policy GRPO).
A full buffer makes `add` wait (backpressure on the producers) up to its timeout.
SFT groups (demonstrations) have no staleness and no signal check; a batch holds groups of one
objective, so a batch taken where SFT groups give way to GRPO ones may be short.
The ids of groups dropped as stale wait in `dropped_stale_ids` until the learner names them in a
step result (`drain_dropped`); a failed step's groups go back to the front (`put_back`).
"""

from __future__ import annotations

import asyncio
from collections import deque

from pydantic import BaseModel

from learner.grpo import group_has_signal
from learner.types import Objective, RewardStatus, RolloutGroup


class BufferCounters(BaseModel):
    groups_received: int = 0
    dropped_stale: int = 0
    dropped_all_equal: int = 0
    # Samples whose environment failed (masked out of training).
    infra_errors: int = 0
    # Policy lag (versions) over the trained tokens of the last batch taken.
    last_policy_lag_mean: float = 0.0
    last_policy_lag_max: int = 0


class RolloutBuffer:
    """Bounded FIFO of rollout groups for one asyncio event loop.

    Groups without signal (fewer than two SCORED samples, or all scored rewards equal) are
    counted and dropped on arrival: they would train nothing and only hold a slot.
    """

    def __init__(self, capacity: int, max_staleness: int) -> None:
        if capacity < 1:
            raise ValueError(f"RolloutBuffer capacity must be >= 1, got {capacity}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.counters = BufferCounters()
        self._groups: deque[RolloutGroup] = deque()
        self._changed = asyncio.Condition()
        self.dropped_stale_ids: list[str] = []

    def __len__(self) -> int:
        return len(self._groups)

    async def add(self, group: RolloutGroup, timeout: float | None = 60.0) -> bool:
        """Queue a group, waiting while the buffer is full; False if it was dropped (no signal).

        Raises TimeoutError when no slot frees up within `timeout` seconds.
        """
        self.counters.groups_received += 1
        self.counters.infra_errors += sum(
            s.reward_status is RewardStatus.INFRA_ERROR for s in group.samples
        )
        sft = group.objective is Objective.SFT  # demonstrations: no signal to check, never stale
        if not sft and (group.oldest_version is None or not group_has_signal(group)):
            self.counters.dropped_all_equal += 1
            return False
        async with self._changed:
            await asyncio.wait_for(
                self._changed.wait_for(lambda: len(self._groups) < self.capacity), timeout
            )
            self._groups.append(group)
            self._changed.notify_all()
        return True

    async def take(
        self, n_groups: int, current_version: int, timeout: float | None = 60.0
    ) -> list[RolloutGroup]:
        """Wait for `n_groups` groups fresh enough for `current_version`, dropping stale ones.

        Raises TimeoutError when they do not arrive within `timeout` seconds; groups already
        taken are put back at the front so nothing is lost.
        """
        if n_groups < 1:
            raise ValueError(f"take needs n_groups >= 1, got {n_groups}")
        taken: list[RolloutGroup] = []

        def ready() -> bool:  # runs with the lock held
            if self._groups and len(taken) < n_groups:
                self._changed.notify_all()  # slots are freed below: wake waiting producers
            while self._groups and len(taken) < n_groups:
                if taken and self._groups[0].objective is not taken[0].objective:
                    return True  # one objective per batch: the next one starts the next batch
                group = self._groups.popleft()
                oldest = group.oldest_version
                if oldest is not None and current_version - oldest > self.max_staleness:
                    self.counters.dropped_stale += 1
                    self.dropped_stale_ids.append(group.group_id)
                else:
                    taken.append(group)
            return len(taken) == n_groups

        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(ready), timeout)
            except TimeoutError:
                self._groups.extendleft(reversed(taken))
                raise
        self._record_lag(taken, current_version)
        return taken

    def put_back(self, groups: list[RolloutGroup]) -> None:
        """Return groups taken for a step that failed, ahead of every newer group. They held
        slots before, so capacity is not checked."""
        self._groups.extendleft(reversed(groups))

    def ids(self) -> set[str]:
        """The ids of the groups waiting now."""
        return {g.group_id for g in self._groups}

    def drain_dropped(self) -> list[str]:
        """The ids dropped as stale since the last call."""
        dropped, self.dropped_stale_ids = self.dropped_stale_ids, []
        return dropped

    def _record_lag(self, groups: list[RolloutGroup], current_version: int) -> None:
        lags = [
            current_version - v
            for g in groups
            if g.objective is Objective.GRPO
            for s in g.samples
            if s.reward_status is RewardStatus.SCORED
            for v, m in zip(s.policy_versions, s.loss_mask)
            if m == 1
        ]
        self.counters.last_policy_lag_mean = sum(lags) / len(lags) if lags else 0.0
        self.counters.last_policy_lag_max = max(lags, default=0)
