"""Fork on a real server process: a fork starts at its parent's step and evolves on its own
(toy and gsm8k by copy, notebook by replaying cells on a copy of the workspace), retries with
the same request_id answer the same fork, ended or unknown episodes cannot be forked, and every
fork is closed like any episode."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sciproto.client.env import EnvClient, new_request_id, tool_calls_action
from sciproto.errors import FailedPrecondition, NotFound, Reason
from sciproto.pb import common_pb2, env_pb2
from sciproto.processes import ServerProcess
from tests.env_servers.answers import expected_answer
from tests.env_servers.conftest import edit_cell, serve_env, submit, text, wait_for_live_episodes


@pytest.fixture(scope="module")
def fork_server() -> Iterator[ServerProcess]:
    yield from serve_env("fork", "envs=[toy,gsm8k,notebook]")


async def test_describe_says_how_each_environment_forks(fork_server: ServerProcess) -> None:
    async with EnvClient(fork_server.target) as client:
        described = await client.describe()
    modes = {env.name: env.fork for env in described.environments}
    assert modes == {"toy": env_pb2.FORK_MODE_COPY, "gsm8k": env_pb2.FORK_MODE_COPY,
                     "notebook": env_pb2.FORK_MODE_REPLAY}
    assert "fork" in described.server.capabilities


async def test_a_toy_fork_evolves_independently_and_an_ended_one_cannot_fork(fork_server: ServerProcess) -> None:
    async with EnvClient(fork_server.target) as client:
        parent = await client.reset("toy", split="test", index=0)
        fork = await client.fork(parent.episode_id)
        assert (fork.parent_episode_id, fork.step_count) == (parent.episode_id, 0)
        assert fork.episode_id != parent.episode_id
        assert [tool.name for tool in fork.tools] == ["submit_answer"]
        forked = await client.step(fork.episode_id, common_pb2.ChatMessage(role=common_pb2.ROLE_ASSISTANT,
                                                                           content="1234"))
        assert (forked.reward.value, forked.terminated, forked.step_count) == (1.0, True, 1)
        # The parent has not been stepped by the fork's step: it still takes its own reply.
        own = await client.step(parent.episode_id, common_pb2.ChatMessage(role=common_pb2.ROLE_ASSISTANT,
                                                                          content="ab"))
        assert (own.reward.value, own.terminated) == (0.0, True)
        with pytest.raises(FailedPrecondition) as finished:
            await client.fork(parent.episode_id)
        assert finished.value.reason == Reason.EPISODE_FINISHED
        with pytest.raises(NotFound) as unknown:
            await client.fork("no-such-episode")
        assert unknown.value.reason == Reason.EPISODE_NOT_FOUND
        for episode_id in (parent.episode_id, fork.episode_id):
            assert (await client.close(episode_id)).closed
        with pytest.raises(NotFound) as closed:
            await client.fork(parent.episode_id)
        assert closed.value.reason == Reason.EPISODE_NOT_FOUND
    assert await wait_for_live_episodes(fork_server.target, 0) == 0


async def test_a_gsm8k_fork_keeps_the_step_count_and_is_graded_on_its_own(fork_server: ServerProcess) -> None:
    answer = expected_answer("gsm8k", "test", 0)
    async with EnvClient(fork_server.target) as client:
        parent = await client.reset("gsm8k", split="test", index=0)
        await client.step(parent.episode_id, tool_calls_action(("calculator", {"expr": "6*7"})))
        request_id = new_request_id()
        fork = await client.fork(parent.episode_id, request_id=request_id)
        retried = await client.fork(parent.episode_id, request_id=request_id)
        assert retried.episode_id == fork.episode_id  # a retry opens no second fork
        assert fork.step_count == 1
        right = await client.step(fork.episode_id, submit(answer))
        assert (right.reward.value, right.terminated, right.step_count) == (1.0, True, 2)
        calc = await client.step(parent.episode_id, tool_calls_action(("calculator", {"expr": "2+2"})))
        assert not calc.terminated and "4" in text(calc.observations)
        wrong = await client.step(parent.episode_id, submit("-1"))
        assert (wrong.reward.value, wrong.terminated, wrong.step_count) == (0.0, True, 3)
        assert (await client.verify(fork.episode_id)).reward.value == 1.0
        assert (await client.verify(parent.episode_id)).reward.value == 0.0
        described = await client.describe()
        assert described.counters.live_episodes == 2
        for episode_id in (parent.episode_id, fork.episode_id):
            await client.close(episode_id)
    assert await wait_for_live_episodes(fork_server.target, 0) == 0


async def test_a_notebook_fork_has_the_parents_variables_and_files_and_its_own_workspace(
        fork_server: ServerProcess) -> None:
    async with EnvClient(fork_server.target) as client, client.session() as session:
        parent = await session.reset("notebook", split="test", index=0)
        await session.step(parent.episode_id, edit_cell("x = 41\nopen('made.txt', 'w').write('hi')"))
        fork = await session.fork(parent.episode_id)
        assert fork.step_count == 1
        seen = await session.step(fork.episode_id, edit_cell(
            "print('fork sees', x + 1, open('made.txt').read())\nopen('fork_only.txt', 'w').write('f')\nx = 7"))
        assert "fork sees 42 hi" in text(seen.observations)
        own = await session.step(parent.episode_id, edit_cell(
            "import os\nprint('parent', x, os.path.exists('fork_only.txt'))"))
        assert "parent 41 False" in text(own.observations)
        assert (await client.describe()).counters.live_episodes >= 2
    # The stream's end closes the parent and its fork alike.
    assert await wait_for_live_episodes(fork_server.target, 0) == 0
