"""The registry's bound on an environment's own work (reset and fork): a slow one is STEP_TIMEOUT,
one that raises is ENVIRONMENT_FAILED, and neither leaves an episode or an admission place behind."""

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
