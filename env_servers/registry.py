"""Live episodes: one Aviary environment each, a lock that serializes its operations (Aviary does
not serialize steps on one environment), idle expiry, a cap on how many are open, and counters.

With authentication on, every episode belongs to the principal that opened it: it counts against
that principal's live-episode quota until it is closed (by Close, the end of its Session stream,
expiry or shutdown), and to every other principal it does not exist, so one team can neither
step, grade nor close another team's episodes.

Nothing here knows the wire format: the service converts requests into calls on this registry
and its results into responses.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from aviary.core import Environment, Message, Tool

from env_servers.catalog import reward_components
from sciproto.auth import claim_episode, current_principal
from sciproto.errors import (
    FailedPrecondition,
    Internal,
    NotFound,
    Reason,
    ResourceExhausted,
    SciprotoError,
)
from sciproto.limits import EpisodeClaim
from sciproto.memory import release_freed_memory

T = TypeVar("T")

log = logging.getLogger("env_servers.registry")

# How long closing one environment may take before it is abandoned (kernel shutdown, temp dirs).
CLOSE_TIMEOUT_S = 30.0


@dataclass
class StepOutcome:
    """What one step did. `failure` is set when the environment itself failed (the reward is then
    an infrastructure error, not a judgement of the agent)."""

    observations: list[Message]
    reward: float
    terminated: bool
    truncated: bool
    step_count: int
    components: dict[str, float] = field(default_factory=dict)
    failure: str | None = None


@dataclass
class Episode:
    """One open episode. Operations on it hold `lock`; `last_used` drives idle expiry."""

    id: str
    env_name: str
    env: Environment
    tools: list[Tool]
    owner: str | None = None  # principal that opened it; None when authentication is off
    claim: EpisodeClaim = field(default_factory=lambda: EpisodeClaim(None))  # its place in the owner's quota
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_used: float = field(default_factory=time.monotonic)
    step_count: int = 0
    total_reward: float = 0.0  # return = sum of step rewards
    terminated: bool = False
    truncated: bool = False
    failure: str | None = None  # why the environment failed, if it did
    closed: bool = False

    @property
    def finished(self) -> bool:
        return self.terminated or self.truncated or self.failure is not None

    def touch(self) -> None:
        self.last_used = time.monotonic()

    async def step(self, action: Message, timeout_s: float) -> StepOutcome:
        """Apply `action` under the episode's lock; a raising or overrunning environment fails
        the episode instead of failing the call."""
        async with self.lock:
            if self.closed:
                raise NotFound(f"episode {self.id} was closed while this step waited for it",
                               Reason.EPISODE_NOT_FOUND)
            if self.finished:
                state = f"failed ({self.failure})" if self.failure else (
                    "terminated" if self.terminated else "truncated")
                raise FailedPrecondition(
                    f"episode {self.id} has {state} after {self.step_count} steps; Reset a new episode",
                    Reason.EPISODE_FINISHED)
            self.touch()
            try:
                async with asyncio.timeout(timeout_s):
                    observations, reward, terminated, truncated = await self.env.step(action)
            except TimeoutError:
                return self._fail(f"the environment did not finish the step within {timeout_s:g} s")
            except asyncio.CancelledError:  # the environment's state is unknown after this
                self._fail("a step was cancelled while the environment ran it")
                raise
            except Exception as error:  # the environment's failure, not the caller's
                log.warning("episode %s (%s): step raised", self.id, self.env_name, exc_info=True)
                return self._fail(f"the environment raised {type(error).__name__}: {error}")
            finally:
                self.touch()
            self.step_count += 1
            self.total_reward += float(reward)
            self.terminated, self.truncated = bool(terminated), bool(truncated)
            components = reward_components(self.env) if self.finished else {}
            return StepOutcome(list(observations), float(reward), self.terminated, self.truncated,
                               self.step_count, components)

    def _fail(self, reason: str) -> StepOutcome:
        self.step_count += 1
        self.failure = reason
        return StepOutcome([], 0.0, False, True, self.step_count, failure=reason)

    async def close(self) -> None:
        """Close the environment once no operation holds the episode; failures are logged. The
        owner's quota gets the episode back at once, whatever closing the environment does."""
        self.closed = True
        self.claim.release()
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                async with self.lock:
                    await self.env.close()
        except Exception:
            log.warning("episode %s (%s): closing the environment failed", self.id, self.env_name,
                        exc_info=True)


@dataclass
class Counters:
    opened: int = 0  # forks included
    forked: int = 0
    expired: int = 0
    steps: int = 0
    errors: int = 0


class EpisodeRegistry:
    """The open episodes of one server."""

    def __init__(self, max_live_episodes: int, idle_ttl_s: float, step_timeout_s: float,
                 retry_after_s: float) -> None:
        self.max_live_episodes = max_live_episodes
        self.idle_ttl_s = idle_ttl_s
        self.step_timeout_s = step_timeout_s
        self.retry_after_s = retry_after_s
        self.counters = Counters()
        self._episodes: dict[str, Episode] = {}
        self._opening = 0  # Resets admitted but not yet registered
        self._sweeper: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self.memory_releases = 0  # times an idle server gave freed memory back (_sweep_forever)

    @property
    def live(self) -> int:
        return len(self._episodes)

    @property
    def opening(self) -> int:
        """Resets and Forks admitted and not yet registered."""
        return self._opening

    def start(self) -> None:
        """Start expiring idle episodes (needs a running event loop)."""
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def open(self, env_name: str, make: Callable[[], Awaitable[Environment]],
                   seed: int | None = None) -> tuple[Episode, list[Message]]:
        """Build an environment with `make`, reset it (with `seed` where its reset takes one),
        and register it as a new episode of the calling principal. Beyond `max_live_episodes`,
        or beyond the principal's own quota, the caller is told to come back later."""
        self._admit()
        claim = claim_episode(self.retry_after_s)
        registered = False
        self._opening += 1
        try:
            env = await make()
            try:
                observations, tools = await self._reset(env, seed)
            except BaseException:
                await Episode("", env_name, env, []).close()
                raise
            episode = Episode(uuid.uuid4().hex, env_name, env, list(tools), owner=_caller(), claim=claim)
            self._episodes[episode.id] = episode
            registered = True
            self.counters.opened += 1
            return episode, list(observations)
        finally:
            self._opening -= 1
            if not registered:
                claim.release()

    async def fork(self, parent: Episode,
                   copy: Callable[[Environment], Awaitable[Environment]]) -> Episode:
        """Register a copy of `parent` (from `get`) made by `copy` as a new episode of the calling
        principal, at the parent's step and return. The copy is made under the parent's lock (no
        step changes it meanwhile) and counts against the same limits as a Reset; a parent that
        was closed meanwhile is EPISODE_NOT_FOUND, a finished one EPISODE_FINISHED."""
        self._admit()
        claim = claim_episode(self.retry_after_s)
        registered = False
        env: Environment | None = None
        self._opening += 1
        try:
            async with parent.lock:
                if parent.closed:
                    raise NotFound(f"episode {parent.id} was closed before it could be forked",
                                   Reason.EPISODE_NOT_FOUND, metadata={"episode_id": parent.id})
                if parent.finished:
                    raise FailedPrecondition(
                        f"episode {parent.id} has ended after {parent.step_count} steps; only an episode"
                        " still running can be forked", Reason.EPISODE_FINISHED,
                        metadata={"episode_id": parent.id})
                parent.touch()
                try:
                    env = await self._bounded("fork", f"episode {parent.id} ({parent.env_name})", copy(parent.env))
                finally:
                    parent.touch()
            episode = Episode(uuid.uuid4().hex, parent.env_name, env, list(env.tools), owner=_caller(),
                              claim=claim, step_count=parent.step_count, total_reward=parent.total_reward)
            self._episodes[episode.id] = episode
            registered = True
            self.counters.opened += 1
            self.counters.forked += 1
            return episode
        finally:
            self._opening -= 1
            if not registered:
                claim.release()
                if env is not None:
                    await Episode("", parent.env_name, env, []).close()

    def _admit(self) -> None:
        """TOO_MANY_EPISODES when the server holds as many episodes as it may."""
        if self.live + self._opening >= self.max_live_episodes:
            raise ResourceExhausted(
                f"{self.max_live_episodes} episodes are open, the most this server holds; close"
                f" finished episodes or retry after {self.retry_after_s:g} s",
                Reason.TOO_MANY_EPISODES, retry_after_s=self.retry_after_s,
                metadata={"max_live_episodes": str(self.max_live_episodes)})

    async def _reset(self, env: Environment, seed: int | None) -> tuple[list[Message], list[Tool]]:
        takes_seed = seed is not None and "seed" in inspect.signature(env.reset).parameters
        return await self._bounded("reset", type(env).__name__, env.reset(seed=seed) if takes_seed else env.reset())

    async def _bounded(self, operation: str, what: str, work: Awaitable[T]) -> T:
        """`work` (an environment's reset or fork) within the step timeout: STEP_TIMEOUT past it,
        ENVIRONMENT_FAILED (logged) when the environment raises; protocol errors pass unchanged."""
        try:
            async with asyncio.timeout(self.step_timeout_s):
                return await work
        except TimeoutError:
            raise Internal(f"the environment did not finish its {operation} within {self.step_timeout_s:g} s",
                           Reason.STEP_TIMEOUT) from None
        except SciprotoError:
            raise
        except Exception as error:
            log.warning("%s: %s raised", what, operation, exc_info=True)
            raise Internal(f"the environment failed to {operation}: {type(error).__name__}: {error}",
                           Reason.ENVIRONMENT_FAILED) from error

    def find(self, episode_id: str) -> Episode | None:
        """The open episode `episode_id` if the calling principal owns it, else None."""
        episode = self._episodes.get(episode_id)
        return episode if episode is not None and episode.owner == _caller() else None

    def get(self, episode_id: str) -> Episode:
        """The caller's open episode `episode_id`, or EPISODE_NOT_FOUND (also for an episode of
        another principal: its existence is not revealed)."""
        episode = self.find(episode_id)
        if episode is None:
            raise NotFound(
                f"no open episode {episode_id!r}: it was never opened here, was closed, or expired"
                f" after {self.idle_ttl_s:g} s idle; Reset a new one",
                Reason.EPISODE_NOT_FOUND, metadata={"episode_id": episode_id})
        return episode

    async def step(self, episode: Episode, action: Message) -> StepOutcome:
        """Step an episode from `get`, counting the step (and the failure, if the environment
        failed)."""
        outcome = await episode.step(action, self.step_timeout_s)
        self.counters.steps += 1
        if outcome.failure is not None:
            self.counters.errors += 1
        return outcome

    async def close(self, episode_id: str) -> bool:
        """Close one of the caller's episodes; False if it was not open, or is another
        principal's, as for an episode never opened (closing twice is not an error)."""
        if self.find(episode_id) is None:
            return False
        episode = self._episodes.pop(episode_id)
        await episode.close()
        return True

    async def close_all(self, episode_ids: list[str]) -> int:
        """Close the open ones of several episodes, whoever owns them, even if the caller is
        being cancelled; returns how many were open. For the server's own cleanup (stream end,
        expiry, shutdown), never on a caller's request."""
        episodes = [e for e in (self._episodes.pop(i, None) for i in episode_ids) if e is not None]
        if episodes:
            closing = asyncio.ensure_future(asyncio.gather(*(e.close() for e in episodes)))
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(closing)
        return len(episodes)

    async def aclose(self) -> None:
        """Stop expiring and close every episode (server shutdown)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        await self.close_all(list(self._episodes))
        if self._closing:
            await asyncio.wait(self._closing, timeout=CLOSE_TIMEOUT_S)

    async def _sweep_forever(self) -> None:
        period = min(max(self.idle_ttl_s / 4, 0.05), 30.0)
        released_after = 0  # episodes opened (counters.opened) when memory was last given back
        quiet: tuple[float, int] | None = None  # (since when, episodes opened by then) with none open
        while True:
            await asyncio.sleep(period)
            await self.expire_idle()
            opened, now = self.counters.opened, time.monotonic()
            if self._episodes or self._opening or opened == released_after:
                quiet = None  # in use, or nothing new since the last release
                continue
            if quiet is None or quiet[1] != opened:
                quiet = (now, opened)
            elif now - quiet[0] >= self.idle_ttl_s:
                # An idle TTL after the last episode closed, the answers kept for its retries have
                # expired as well: what the burst allocated is free, so give it back.
                release_freed_memory()
                self.memory_releases += 1
                released_after, quiet = opened, None

    async def expire_idle(self) -> None:
        """Close episodes idle for longer than the TTL; an episode in the middle of an operation
        is never idle."""
        deadline = time.monotonic() - self.idle_ttl_s
        idle = [e.id for e in self._episodes.values() if e.last_used < deadline and not e.lock.locked()]
        if idle:
            log.info("closing %d episodes idle for more than %g s", len(idle), self.idle_ttl_s)
            expired = await self.close_all(idle)
            self.counters.expired += expired


def _caller() -> str | None:
    """The name of the principal making the current call; None when authentication is off."""
    principal = current_principal()
    return principal.name if principal is not None else None
