"""`sciproto agent-collect`: rollouts of an external agent program, through the gateway.

For each task the env server's Reset gives the observation and tools; the command then runs
`--group-size` times, each run with its own gateway session and, in its environment,
`OPENAI_BASE_URL` (the session's base URL), `OPENAI_API_KEY`, and `SCIPROTO_TASK` (JSON: env, split,
index, the Reset observation as OpenAI messages, the tools as OpenAI function tools). When the run
exits 0, its session's last conversation is graded by the env server's Verify (a stored trajectory
of that task) and the session closes with that reward; a run that fails, times out, or makes no
call is recorded as INFRA_ERROR. The records go to `--out` as `sciproto collect` writes them.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from gateway.chat import Choice
from gateway.local import LocalGateway
from sciproto.client.env import EnvClient
from policy_server.convert import tool_spec
from sciproto.client.rollouts import MessageRecord
from sciproto.pb import common_pb2, env_pb2

__all__ = ["collect_agent", "main"]


def _openai_message(message: common_pb2.ChatMessage) -> dict[str, Any]:
    record = MessageRecord.from_pb(message)
    out: dict[str, Any] = {"role": record.role, "content": record.content}
    if record.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in record.tool_calls]
    if record.role == "tool":
        out["tool_call_id"] = record.tool_call_id
    return out


def _reply(choice: Choice) -> common_pb2.ChatMessage:
    return common_pb2.ChatMessage(role=common_pb2.ROLE_ASSISTANT, content=choice.content, tool_calls=[
        common_pb2.ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
        for c in choice.tool_calls])


async def collect_agent(*, env_target: str, policy_target: str, env: str, split: str, tasks: range,
                        group_size: int, command: str, out: Path, timeout_s: float = 600.0) -> dict[str, Any]:
    """Run the command over `tasks` of `env`/`split`; returns counts and the mean scored reward."""
    argv = shlex.split(command)
    async with EnvClient(env_target, transport="unary") as envs, LocalGateway([policy_target],
                                                                               rollouts_file=out) as gateway:
        assert gateway.gateway is not None
        store = gateway.gateway.store
        records = []  # this run's only: `out` is appended to and may hold earlier runs'
        for index in tasks:
            reset = await envs.reset(env, split=split, index=index)
            await envs.close(reset.episode_id)
            task = json.dumps({"env": env, "split": split, "index": index,
                               "messages": [_openai_message(m) for m in reset.observations],
                               "tools": [tool_spec(t, i) for i, t in enumerate(reset.tools)]})

            async def run(base_url: str, task: str = task, index: int = index) -> float:
                process = await asyncio.create_subprocess_exec(
                    *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
                    env={**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": "sciproto",
                         "SCIPROTO_TASK": task})
                try:
                    _, stderr = await asyncio.wait_for(process.communicate(), timeout_s)
                except TimeoutError:
                    process.kill()
                    await process.wait()
                    raise RuntimeError(f"the agent ran past {timeout_s:.0f} s") from None
                if process.returncode != 0:
                    tail = stderr.decode(errors="replace").strip().splitlines()[-3:]
                    raise RuntimeError(f"the agent exited {process.returncode}: {' | '.join(tail)}")
                session = store.sessions.get(base_url.rstrip("/").split("/")[-2])
                if session is None or not session.calls:
                    raise RuntimeError("the agent exited without calling the model")
                last = session.calls[-1]
                messages = [*last.messages, _reply(last.choices[last.chosen])]
                trajectory = env_pb2.StoredTrajectory(env=env, task_ref=env_pb2.TaskRef(split=split, index=index),
                                                      messages=messages)
                reward = (await envs.verify(trajectory=trajectory)).reward
                if reward.status == common_pb2.REWARD_STATUS_INFRA_ERROR:
                    raise RuntimeError(f"Verify failed: {reward.detail}")
                return reward.value

            records += (await gateway.run_group(run, f"{env}/{split}/{index}", group_size)).rollouts
    scored = [r.reward for r in records if r.status == "SCORED"]
    return {"records": len(records), "scored": len(scored), "infra_errors": sum(r.status == "INFRA_ERROR"
                                                                                  for r in records),
            "mean_reward": sum(scored) / len(scored) if scored else None, "out": str(out)}


def main(**options: Any) -> None:
    summary = asyncio.run(collect_agent(**options))
    print(json.dumps(summary))
    if summary["scored"] == 0:
        print("sciproto agent-collect: no run was scored; see the records' `error`", file=sys.stderr)
        raise SystemExit(1)
