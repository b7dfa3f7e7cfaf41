"""The registry on its own: the bound on an environment's reset and fork (a slow one is STEP_TIMEOUT,
one that raises ENVIRONMENT_FAILED, neither leaves an episode behind) and giving memory back when idle."""

from __future__ import annotations

import asyncio

import pytest
from aviary.core import Environment, Message, Messages, Tool

from env_servers.registry import EpisodeRegistry
from sciproto.errors import Internal, Reason


class Stubborn(Environment[None]):
    """An Aviary environment whose reset (or copy) hangs or raises, as `how` says."""

    def __init__(self, how: str = "") -> None:
        self.how = how
        self.closed = False

    async def reset(self) -> tuple[Messages, list[Tool]]:
        await self._misbehave()
        return [Message(content="ready")], []

    async def step(self, action: Message) -> tuple[Messages, float, bool, bool]:
        return [], 0.0, True, False

    async def close(self) -> None:
        self.closed = True

    async def _misbehave(self) -> None:
        if self.how == "hang":
            await asyncio.sleep(60)
        if self.how == "raise":
            raise RuntimeError("the kernel did not start")


@pytest.mark.parametrize(("how", "reason", "says"), [
    ("hang", Reason.STEP_TIMEOUT, "did not finish its {} within 0.2 s"),
    ("raise", Reason.ENVIRONMENT_FAILED, "failed to {}: RuntimeError: the kernel did not start"),
])
async def test_a_reset_or_fork_that_hangs_or_raises_is_bounded_and_leaves_nothing_open(
        how: str, reason: str, says: str) -> None:
    registry = EpisodeRegistry(max_live_episodes=1, idle_ttl_s=60, step_timeout_s=0.2, retry_after_s=1)
    broken = Stubborn(how)

    async def make() -> Environment:
        return broken

    with pytest.raises(Internal) as reset:
        await registry.open("stubborn", make)
    assert reset.value.reason == reason and says.format("reset") in reset.value.message
    assert broken.closed and registry.live == 0

    async def healthy() -> Environment:
        return Stubborn()

    async def copy(env: Environment) -> Environment:
        await Stubborn(how)._misbehave()
        return Stubborn()

    registry.max_live_episodes = 2  # room for the fork: only the bound can fail it
    parent, _ = await registry.open("stubborn", healthy)
    with pytest.raises(Internal) as fork:
        await registry.fork(parent, copy)
    assert fork.value.reason == reason and says.format("fork") in fork.value.message
    assert registry.live == 1  # the parent alone
    assert await registry.close(parent.id) and registry.live == 0


async def _until(condition, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_an_idle_server_gives_freed_memory_back_once_per_burst() -> None:
    """One idle TTL after its last episode closed (its retry answers have expired too), the server
    collects and trims its heap, once: not while episodes are open, not again while idle."""
    registry = EpisodeRegistry(max_live_episodes=4, idle_ttl_s=1.0, step_timeout_s=5, retry_after_s=1)
    registry.start()

    async def make() -> Environment:
        return Stubborn()

    try:
        episode, _ = await registry.open("stubborn", make)
        for _ in range(15):  # in use for 1.5 s, more than the idle TTL (touched well within it)
            episode.touch()
            await asyncio.sleep(0.1)
        assert registry.memory_releases == 0 and registry.live == 1, "an episode is open"
        await registry.close(episode.id)
        await _until(lambda: registry.memory_releases == 1)
        await asyncio.sleep(1.5)
        assert registry.memory_releases == 1, "nothing new to give back while idle"
        episode, _ = await registry.open("stubborn", make)
        await registry.close(episode.id)
        await _until(lambda: registry.memory_releases == 2)
    finally:
        await registry.aclose()
