"""Per-principal limits: a request rate (token bucket) and a quota of live
episodes. The auth interceptor enforces the rate; an environment server's
episode registry takes and returns episode claims."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sciproto.errors import Reason, ResourceExhausted


class PrincipalLimits(BaseModel):
    """What one token may use; None means unlimited."""

    model_config = ConfigDict(extra="forbid")

    requests_per_second: float | None = Field(None, gt=0, description="Sustained calls per second (every RPC counts once)")
    burst: int | None = Field(None, ge=1, description="Calls allowed at once above the rate; default ceil(requests_per_second)")
    max_live_episodes: int | None = Field(None, ge=1, description="Episodes open at the same time on one env server")

    @model_validator(mode="after")
    def _burst_needs_rate(self) -> PrincipalLimits:
        if self.burst is not None and self.requests_per_second is None:
            raise ValueError("burst is set without requests_per_second: set the rate too, or drop burst")
        return self

    def over(self, defaults: PrincipalLimits) -> PrincipalLimits:
        """These limits, with every field left unset taken from `defaults`."""
        return defaults.model_copy(update=self.model_dump(exclude_unset=True))


class TokenBucket:
    """Rate limiter: holds up to `burst` tokens, refilled at `rate` per second;
    each call takes one.

        tokens(t) = min(burst, tokens(t0) + rate * (t - t0))
        wait for the next token = (1 - tokens) / rate
    """

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self.tokens = float(burst)
        self.updated = clock()

    def try_take(self) -> float:
        """Take a token: 0.0 on success, else the seconds until one is available."""
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + self.rate * (now - self.updated))
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


def bucket_for(limits: PrincipalLimits) -> TokenBucket | None:
    if limits.requests_per_second is None:
        return None
    burst = limits.burst if limits.burst is not None else max(1, math.ceil(limits.requests_per_second))
    return TokenBucket(limits.requests_per_second, burst)


class EpisodeClaim:
    """One live episode counted against a principal's quota. Release it when
    the episode closes, expires or its Session stream ends; releasing twice
    is harmless, so every exit path may call it."""

    def __init__(self, quota: LiveEpisodeQuota | None) -> None:
        self._quota = quota

    def release(self) -> None:
        quota, self._quota = self._quota, None
        if quota is not None:
            quota._release()


class LiveEpisodeQuota:
    """Counts a principal's open episodes against `limit` (None: no limit)."""

    def __init__(self, owner: str, limit: int | None) -> None:
        self.owner = owner
        self.limit = limit
        self.live = 0
        # Registries may open and close episodes from worker threads.
        self._lock = threading.Lock()

    def claim(self, retry_after_s: float = 1.0) -> EpisodeClaim:
        """Count one more live episode, or raise RESOURCE_EXHAUSTED
        (TOO_MANY_EPISODES, RetryInfo `retry_after_s`) at the limit."""
        with self._lock:
            if self.limit is not None and self.live >= self.limit:
                raise ResourceExhausted(
                    f"principal {self.owner!r} already has {self.live} live episodes, its limit; "
                    "close finished episodes (Close, or end the Session stream) before opening more",
                    Reason.TOO_MANY_EPISODES,
                    metadata={"principal": self.owner, "max_live_episodes": str(self.limit)},
                    retry_after_s=retry_after_s,
                )
            self.live += 1
        return EpisodeClaim(self)

    def _release(self) -> None:
        with self._lock:
            self.live -= 1
