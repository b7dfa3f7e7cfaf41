"""`sciproto agent-collect`: rollouts of an external agent program, through the gateway.

Each task's group is `--group-size` runs of the command, graded by the env server's Verify
(clients.external_agent says what a run is given and how it is graded). The records go to `--out`
as `sciproto collect` writes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from clients.agent_process import AgentProgram, AgentStartError, launcher
from clients.external_agent import run_agent_group
from gateway.local import LocalGateway
from sciproto.client.env import EnvClient
from sciproto.client.rollouts import TaskKey

__all__ = ["collect_agent", "main"]


async def collect_agent(*, env_target: str, policy_target: str, env: str, split: str, tasks: range,
                        group_size: int, command: str, out: Path, timeout_s: float = 600.0,
                        preload: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run the command over `tasks` of `env`/`split`; returns counts and the mean scored reward."""
    program = AgentProgram(command, timeout_s, preload)
    async with (launcher(program) as launch, EnvClient(env_target, transport="unary") as envs,
                LocalGateway([policy_target], rollouts_file=out) as gateway):
        @contextlib.asynccontextmanager
        async def lease() -> AsyncIterator[EnvClient]:
            yield envs

        records = []  # this run's only: `out` is appended to and may hold earlier runs'
        for index in tasks:
            group = await run_agent_group(gateway, lease, launch, TaskKey(env, split, index), group_size)
            records += group.rollouts
    scored = [r.reward for r in records if r.status == "SCORED"]
    return {"records": len(records), "scored": len(scored), "infra_errors": sum(r.status == "INFRA_ERROR"
                                                                                  for r in records),
            "mean_reward": sum(scored) / len(scored) if scored else None, "out": str(out)}


def main(**options: Any) -> None:
    try:
        summary = asyncio.run(collect_agent(**options))
    except (AgentStartError, ValueError) as error:  # a fork server that cannot start, a command it cannot run
        print(f"sciproto agent-collect: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    print(json.dumps(summary))
    if summary["scored"] == 0:
        print("sciproto agent-collect: no run was scored; see the records' `error`", file=sys.stderr)
        raise SystemExit(1)
