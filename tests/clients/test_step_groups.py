"""Step-level groups against a real env server: alternatives of one step are sampled on forks of
the episode, scored by their step reward, the base continues from the best branch, the fork
budget is kept, and every fork is closed."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence

import pytest

from clients.step_groups import StepGrouping, run_step_groups
from sciproto.client.env import EnvClient, tool_calls_action
from sciproto.pb import common_pb2
from sciproto.processes import ServerProcess
from tests.env_servers.answers import expected_answer
from tests.env_servers.conftest import serve_env, submit, wait_for_live_episodes


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    yield from serve_env("step-groups", "envs=[gsm8k,notebook]")


def calculator(expr: str) -> common_pb2.ChatMessage:
    return tool_calls_action(("calculator", {"expr": expr}))



class Scripted:
    """Proposes the given actions, group by group, and records the prompts it saw."""

    def __init__(self, *groups: list[common_pb2.ChatMessage]) -> None:
        self.groups, self.prompts = list(groups), []

    async def __call__(self, prompt: Sequence[common_pb2.ChatMessage], tools: Sequence[common_pb2.ToolSpec],
                       n: int) -> list[common_pb2.ChatMessage]:
        self.prompts.append(list(prompt))
        return self.groups.pop(0)[:n]


async def test_gsm8k_groups_score_each_branch_and_continue_from_the_best(server: ServerProcess) -> None:
    right = expected_answer("gsm8k", "test", 0)
    propose = Scripted([calculator("2+2"), calculator("(("), submit("-1")],
                       [submit("-1"), submit(right), calculator("3*3")])
    async with EnvClient(server.target) as env:
        result = await run_step_groups(env, "gsm8k", "test", 0, propose, StepGrouping(group_size=3))
    first, second = result.groups
    assert first.rewards == [0.0, -1.0, 0.0] and first.chosen == 0
    assert second.rewards == [0.0, 1.0, 0.0] and second.chosen == 1 and result.finished
    assert second.step == 1 and len(second.prompt) > len(first.prompt)  # history: the calculator turn was appended
    assert max(second.advantages()) > 0 > min(second.advantages())
    metrics = result.stats.as_metrics()
    assert metrics["forks_opened"] == metrics["forks_closed"] == 6 and metrics["step_group_reward_std"] > 0
    assert await wait_for_live_episodes(server.target, 0) == 0


async def test_the_fork_budget_bounds_the_groups(server: ServerProcess) -> None:
    propose = Scripted([calculator("1+1"), calculator("2+2")], [calculator("3+3")], [submit("-1")])
    async with EnvClient(server.target) as env:
        result = await run_step_groups(env, "gsm8k", "test", 0, propose,
                                       StepGrouping(group_size=2, max_depth=3, fork_budget=3))
    assert len(result.groups) == 1 and result.stats.forks_opened == result.stats.forks_closed == 2
    assert result.finished and result.stats.steps == 4  # 2 in the group, then one action per step
    assert await wait_for_live_episodes(server.target, 0) == 0


async def test_a_notebook_group_on_the_state_view_closes_every_fork(server: ServerProcess) -> None:
    edit = tool_calls_action(("edit_cell", {"contents": "print('rows')"}))
    propose = Scripted([edit, submit(expected_answer("notebook", "test", 0))])
    async with EnvClient(server.target) as env:
        result = await run_step_groups(env, "notebook", "test", 0, propose, StepGrouping(group_size=2, max_depth=1),
                                       options={"observation": "state"})
    [group] = result.groups
    assert group.rewards == [0.0, 1.0] and group.chosen == 1 and result.finished
    assert result.stats.forks_opened == result.stats.forks_closed == 2
    assert await wait_for_live_episodes(server.target, 0) == 0


async def test_rollout_scoring_plays_each_branch_out_on_a_fork_and_scores_its_return(server: ServerProcess) -> None:
    right = expected_answer("gsm8k", "test", 0)
    # The group: a calculator call (goes on) and a wrong answer (ends with 0); then the play-out
    # of the first branch, on a fork of it, submits the right answer.
    propose = Scripted([calculator("2+2"), submit("-1")], [submit(right)])
    grouping = StepGrouping(group_size=2, max_depth=1, fork_budget=4, scoring="rollout", branch_depth=3)
    async with EnvClient(server.target) as env:
        result = await run_step_groups(env, "gsm8k", "test", 0, propose, grouping)
    [group] = result.groups
    assert group.step_rewards == [0.0, 0.0] and group.rewards == [1.0, 0.0] and group.chosen == 0
    assert len(propose.prompts) == 2 and len(propose.prompts[1]) > len(propose.prompts[0])
    assert result.stats.forks_opened == result.stats.forks_closed == 3  # 2 branches, 1 play-out
    assert await wait_for_live_episodes(server.target, 0) == 0


def test_rollout_scoring_costs_two_forks_per_alternative_and_other_scorings_are_refused() -> None:
    assert StepGrouping(group_size=2, fork_budget=3, scoring="rollout").forks_per_alternative == 2
    with pytest.raises(ValueError, match="scoring"):
        StepGrouping(scoring="best")  # type: ignore[arg-type]


async def test_a_cancelled_task_closes_every_fork_and_its_base(server: ServerProcess) -> None:
    started = asyncio.Event()

    async def propose(prompt: Sequence[common_pb2.ChatMessage], tools: Sequence[common_pb2.ToolSpec],
                      n: int) -> list[common_pb2.ChatMessage]:
        if n == 1:  # the play-out: hang until cancelled, with two branches and a play-out fork open
            started.set()
            await asyncio.Event().wait()
        return [calculator("1+1")] * n

    grouping = StepGrouping(group_size=2, max_depth=2, fork_budget=8, scoring="rollout")
    async with EnvClient(server.target) as env:
        task = asyncio.ensure_future(run_step_groups(env, "gsm8k", "test", 0, propose, grouping))
        await asyncio.wait_for(started.wait(), 30)
        assert await wait_for_live_episodes(server.target, 4) == 4  # base, 2 branches, 1 play-out
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert await wait_for_live_episodes(server.target, 0) == 0
