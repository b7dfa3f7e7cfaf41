"""The notebook environment's context policy (Reset option `observation`) on a real server: with
`state` each step's observation is the whole view (instruction, earlier actions in short, the
current notebook), so it does not pile up the earlier views; bad options are refused."""

from __future__ import annotations

import pytest

from sciproto.client.env import EnvClient
from sciproto.errors import InvalidArgument, Reason
from sciproto.pb import common_pb2
from sciproto.processes import ServerProcess
from tests.env_servers.conftest import edit_cell


async def test_the_state_view_is_the_instruction_the_actions_and_the_current_notebook(
        env_server: ServerProcess) -> None:
    async with EnvClient(env_server.target) as client, client.session() as session:
        reset = await session.reset("notebook", split="test", index=0, options={"observation": "state"})
        instruction = reset.observations[0].content
        for number in range(3):
            step = await session.step(reset.episode_id, edit_cell(f"print('cell', {number} * 11)"))
        [view] = step.observations  # one message: the whole view, no tool message to append
        assert view.role == common_pb2.ROLE_USER and view.content.startswith(instruction)
        assert "Your actions so far:\n1. edit_cell(contents=\"print('cell', 0 * 11)\")" in view.content
        assert "3. edit_cell(" in view.content and "cell 22" in view.content  # the notebook as it is now
        history = await session.reset("notebook", split="test", index=0)
        step = await session.step(history.episode_id, edit_cell("print('cell', 1)"))
        assert [m.role for m in step.observations] == [common_pb2.ROLE_TOOL, common_pb2.ROLE_USER]
        assert not step.observations[1].content.startswith(instruction)


async def test_options_a_notebook_does_not_take_are_refused_saying_what_it_takes(
        env_server: ServerProcess) -> None:
    async with EnvClient(env_server.target) as client:
        for options in ({"observation": "everything"}, {"view": "state"}):
            with pytest.raises(InvalidArgument) as refused:
                await client.reset("notebook", split="test", index=0, options=options)
            assert refused.value.reason == Reason.INVALID_REQUEST
            assert "observation: history | state" in str(refused.value)
        with pytest.raises(InvalidArgument) as gsm8k:
            await client.reset("gsm8k", split="test", index=0, options={"observation": "state"})
        assert "takes no per-episode options" in str(gsm8k.value)
