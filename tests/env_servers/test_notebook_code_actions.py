"""The notebook environment's code actions (Reset option `action: code`) and its cell reward
(`cell_reward`), on a real server with a real sandboxed kernel: a reply's ```python block runs
as the next cell, a reply without one is the answer; a step whose cell runs without an error
earns the cell reward (a shaping term, 0 unless asked for)."""

from __future__ import annotations

import pytest

from sciproto.client.env import EnvClient
from sciproto.errors import InvalidArgument
from sciproto.pb import common_pb2
from sciproto.processes import ServerProcess
from tests.env_servers.conftest import edit_cell, text

REVENUE = ("import pandas as pd\ndf = pd.read_csv('orders.csv')\ndf['revenue'] = df.quantity * df.unit_price\n"
           "print(df.groupby('region').revenue.sum().idxmax())")


def reply(content: str) -> common_pb2.ChatMessage:
    return common_pb2.ChatMessage(role=common_pb2.ROLE_ASSISTANT, content=content)


async def test_a_code_reply_runs_its_block_as_a_cell_and_a_reply_without_one_is_the_answer(
        env_server: ServerProcess) -> None:
    async with EnvClient(env_server.target) as client, client.session() as session:
        reset = await session.reset("notebook", split="test", index=0,
                                    options={"action": "code", "cell_reward": "0.25"})
        assert list(reset.tools) == []  # the reply's text is the action: no tool to call
        assert "```python" in reset.observations[0].content
        ran = await session.step(reset.episode_id, reply(f"Let me compute it.\n```python\n{REVENUE}\n```"))
        assert (ran.reward.value, ran.terminated) == (0.25, False)
        assert "North" in text(list(ran.observations))  # the cell's output, in the notebook
        failed = await session.step(reset.episode_id, reply("```python\nprint(undefined_name)\n```"))
        assert (failed.reward.value, failed.terminated) == (0.0, False)
        assert "NameError" in text(list(failed.observations))
        answered = await session.step(reset.episode_id, reply("The region is North.\nAnswer: North"))
        assert (answered.reward.value, answered.terminated) == (1.0, True)
        verified = (await client.verify(reset.episode_id)).reward
        assert verified.value == 1.25
        assert dict(verified.components) == {"correct": 1.0, "clean_cells": 1.0}
        wrong = await session.reset("notebook", split="test", index=0, options={"action": "code"})
        answered = await session.step(wrong.episode_id, reply("South"))  # no block, no "Answer:": all of it
        assert (answered.reward.value, answered.terminated) == (0.0, True)


async def test_the_cell_reward_counts_clean_edit_cell_calls_in_tool_mode_too(env_server: ServerProcess) -> None:
    async with EnvClient(env_server.target) as client, client.session() as session:
        reset = await session.reset("notebook", split="test", index=0, options={"cell_reward": "0.5"})
        assert "edit_cell" in [tool.name for tool in reset.tools]
        clean = await session.step(reset.episode_id, edit_cell("x = 2 + 2"))
        broken = await session.step(reset.episode_id, edit_cell("x = 1 / 0"))
        assert (clean.reward.value, broken.reward.value) == (0.5, 0.0)
        plain = await session.reset("notebook", split="test", index=0)
        assert (await session.step(plain.episode_id, edit_cell("x = 2 + 2"))).reward.value == 0.0


async def test_code_action_options_are_checked(env_server: ServerProcess) -> None:
    async with EnvClient(env_server.target) as client:
        for options in ({"action": "text"}, {"cell_reward": "lots"}):
            with pytest.raises(InvalidArgument) as refused:
                await client.reset("notebook", split="test", index=0, options=options)
            assert "action: tools | code" in str(refused.value)


def test_a_reply_is_read_as_code_or_as_an_answer() -> None:
    from env_servers.envs.notebook import code_block, final_answer

    assert code_block("Here:\n```python\nprint(1)\n```\nthen more") == "print(1)\n"
    assert code_block("```\nx = 1\n") == "x = 1\n"  # cut off by max_tokens: what there is runs
    assert code_block("no code here") is None and code_block("```python\n```") is None
    assert final_answer("I computed it.\nAnswer: **62.0**.") == "62.0"
    assert final_answer("answer: North\nAnswer: South") == "South" and final_answer(" 0.5 ") == "0.5"


async def test_the_state_view_of_a_code_episode_keeps_the_code_instruction_and_lists_the_cells_run(
        env_server: ServerProcess) -> None:
    async with EnvClient(env_server.target) as client, client.session() as session:
        reset = await session.reset("notebook", split="test", index=0,
                                    options={"action": "code", "observation": "state"})
        instruction = reset.observations[0].content
        step = await session.step(reset.episode_id, reply("```python\nprint(6 * 7)\n```"))
        [view] = step.observations
        assert view.content.startswith(instruction) and "edit_cell" not in instruction
        assert "1. ran a cell: print(6 * 7) -> Appended new cell (#0)." in view.content and "42" in view.content
