"""Groups of an external agent program's runs on an env task, through the gateway.

For a task the env server's Reset gives the observation and tools (the episode is closed at once:
the program plays against the model, not the env). The program then runs `size` times, each run
with its own gateway session and, in its environment, `OPENAI_BASE_URL` (the session's base URL),
`OPENAI_API_KEY`, and `SCIPROTO_TASK` (JSON: env, split, index, the Reset observation as OpenAI
messages, the tools as OpenAI function tools). When a run exits 0, its session's last conversation
is graded by the env server's Verify (a stored trajectory of that task) and the session closes with
that reward; a run that fails, times out, or makes no call is recorded as INFRA_ERROR. The runs
form one `RolloutGroup`, the form `collect` writes and `TrainStep` takes.

`sciproto agent-collect` writes such groups to a file; `sciproto train` with
`rollout.agent: {command: ...}` trains on them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any

from clients.agent_process import Launch
from gateway.chat import Choice
from gateway.local import LocalGateway
from sciproto.chat import tool_spec
from sciproto.client.env import EnvClient
from sciproto.client.rollouts import MessageRecord, RolloutGroup, TaskKey
from sciproto.pb import common_pb2, env_pb2

__all__ = ["EnvLease", "run_agent_group"]

# An env server's client for the calls of one task (a Reset and its Close go to the same server).
EnvLease = Callable[[], AbstractAsyncContextManager[EnvClient]]


def openai_message(message: common_pb2.ChatMessage) -> dict[str, Any]:
    record = MessageRecord.from_pb(message)
    out: dict[str, Any] = {"role": record.role, "content": record.content}
    if record.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in record.tool_calls]
    if record.role == "tool":
        out["tool_call_id"] = record.tool_call_id
    return out


def _reply(choice: Choice) -> common_pb2.ChatMessage:
    """The reply as the agent got it: the sample's parsed calls when it was offered tools."""
    return common_pb2.ChatMessage(role=common_pb2.ROLE_ASSISTANT, content=choice.content,
                                  tool_calls=choice.sample.tool_calls if choice.with_tools else [])


async def task_description(lease: EnvLease, task: TaskKey, options: Mapping[str, str] | None = None) -> str:
    """SCIPROTO_TASK for `task`: its Reset observation and tools, as JSON."""
    async with lease() as envs:
        reset = await envs.reset(task.env, split=task.split, index=task.index, options=options or None)
        await envs.close(reset.episode_id)
    return json.dumps({"env": task.env, "split": task.split, "index": task.index,
                       "messages": [openai_message(m) for m in reset.observations],
                       "tools": [tool_spec(t, i) for i, t in enumerate(reset.tools)]})


async def run_agent_group(gateway: LocalGateway, lease: EnvLease, launch: Launch, task: TaskKey,
                          size: int, options: Mapping[str, str] | None = None) -> RolloutGroup:
    """`size` runs of the program `launch` starts (clients.agent_process) on `task`, each graded by
    Verify, as one group. Groups of the same task may run at once: each has a label of its own."""
    assert gateway.gateway is not None, "use LocalGateway in `async with`"
    store = gateway.gateway.store
    task_json = await task_description(lease, task, options)

    async def run(base_url: str) -> float:
        await launch({"OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": "sciproto", "SCIPROTO_TASK": task_json})
        session = store.sessions.get(base_url.rstrip("/").split("/")[-2])
        if session is None or not session.calls:
            raise RuntimeError("the agent exited without calling the model")
        last = session.calls[-1]
        trajectory = env_pb2.StoredTrajectory(env=task.env, task_ref=env_pb2.TaskRef(split=task.split,
                                                                                    index=task.index),
                                              messages=[*last.messages, _reply(last.choices[last.chosen])])
        async with lease() as envs:
            reward = (await envs.verify(trajectory=trajectory)).reward
        if reward.status == common_pb2.REWARD_STATUS_INFRA_ERROR:
            raise RuntimeError(f"Verify failed: {reward.detail}")
        return reward.value

    return await gateway.run_group(run, f"{task.group_id}#{uuid.uuid4().hex[:12]}", size)
