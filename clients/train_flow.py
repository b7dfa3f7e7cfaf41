"""Flow control of `sciproto train`: how many groups the rollout client may have started and not
yet seen settled by the learner, and how long generation sat idle."""

from __future__ import annotations

import asyncio
import time


class Flow:
    """Counts that gate the rollout client: groups started vs consumed by the learner, and time
    spent with nothing generating."""

    def __init__(self, max_ahead: int) -> None:
        self.max_ahead = max_ahead
        self.started = 0
        self.finished = 0
        self.consumed = 0
        self.changed = asyncio.Condition()
        self.idle_s = 0.0
        self._idle_since: float | None = time.monotonic()

    def _mark(self) -> None:
        now = time.monotonic()
        in_flight = self.started - self.finished
        if in_flight == 0 and self._idle_since is None:
            self._idle_since = now
        elif in_flight > 0 and self._idle_since is not None:
            self.idle_s += now - self._idle_since
            self._idle_since = None

    async def admit(self) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: self.started - self.consumed < self.max_ahead)
            self.started += 1
            self._mark()

    def group_finished(self) -> None:
        self.finished += 1
        self._mark()

    async def consume(self, count: int) -> None:
        async with self.changed:
            self.consumed += count
            self.changed.notify_all()

    def total_idle_s(self) -> float:
        return self.idle_s + (
            time.monotonic() - self._idle_since if self._idle_since is not None else 0.0
        )



__all__ = ["Flow"]
