"""The registry's limits on a real server process configured tight: idle expiry, the episode
cap, and the step timeout."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sciproto.client.env import EnvClient, tool_calls_action
from sciproto.errors import FailedPrecondition, NotFound, Reason, ResourceExhausted
from sciproto.pb import common_pb2
from sciproto.processes import ServerProcess
from tests.env_servers.conftest import serve_env, wait_for_live_episodes

IDLE_TTL_S = 1.5
MAX_LIVE_EPISODES = 2
STEP_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def tight_server() -> Iterator[ServerProcess]:
    yield from serve_env("tight", "envs=[gsm8k,notebook]", f"idle_ttl_s={IDLE_TTL_S}",
                         f"max_live_episodes={MAX_LIVE_EPISODES}", f"step_timeout_s={STEP_TIMEOUT_S}")


async def test_idle_episodes_expire(tight_server: ServerProcess) -> None:
    async with EnvClient(tight_server.target) as client:
        reset = await client.reset("gsm8k", split="test", index=0)
        assert await wait_for_live_episodes(tight_server.target, 0, timeout_s=IDLE_TTL_S * 10) == 0
        with pytest.raises(NotFound) as expired:
            await client.step(reset.episode_id, tool_calls_action(("calculator", {"expr": "1"})))
        assert (await client.describe()).counters.episodes_expired >= 1
    assert expired.value.reason == Reason.EPISODE_NOT_FOUND


async def test_resets_beyond_the_cap_are_refused_with_retry_info(tight_server: ServerProcess) -> None:
    async with EnvClient(tight_server.target) as client:
        opened = [await client.reset("gsm8k", split="test", index=i) for i in range(MAX_LIVE_EPISODES)]
        with pytest.raises(ResourceExhausted) as refused:
            await client.reset("gsm8k", split="test", index=5)
        await client.close(opened[0].episode_id)
        again = await client.reset("gsm8k", split="test", index=5)  # a slot is free again
        for reset in (opened[1], again):
            await client.close(reset.episode_id)
    assert refused.value.reason == Reason.TOO_MANY_EPISODES
    assert refused.value.retry_after_s is not None and refused.value.retry_after_s > 0


async def test_a_step_past_the_timeout_is_an_infra_error_not_a_wrong_answer(tight_server: ServerProcess) -> None:
    async with EnvClient(tight_server.target) as client, client.session() as session:
        reset = await session.reset("notebook", split="test", index=0)
        slow = tool_calls_action(("edit_cell", {"contents": "import time\ntime.sleep(30)"}))
        step = await session.step(reset.episode_id, slow)
        with pytest.raises(FailedPrecondition) as failed:
            await session.step(reset.episode_id, tool_calls_action(("list_workdir", {})))
        verified = await session.verify(reset.episode_id)
        errors = (await client.describe()).counters.errors
    assert step.reward.status == common_pb2.REWARD_STATUS_INFRA_ERROR
    assert "within" in step.reward.detail and step.truncated
    assert failed.value.reason == Reason.EPISODE_FINISHED
    assert verified.reward.status == common_pb2.REWARD_STATUS_INFRA_ERROR
    assert errors >= 1
    assert await wait_for_live_episodes(tight_server.target, 0) == 0  # nothing leaks
