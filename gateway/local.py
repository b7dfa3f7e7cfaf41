"""The gateway in-process, for agents that are Python functions.

    async with LocalGateway(["127.0.0.1:50052"]) as gateway:
        group = await gateway.run_group(my_agent, "gsm8k/train/3", size=4)

`my_agent(base_url)` (a plain or an async function) talks to the OpenAI API at `base_url`, its own
session's, and returns its reward. Each run is closed with that reward; an agent that raises is
closed as INFRA_ERROR (never trained on) with what it raised. The group comes back as the
`RolloutGroup` that training takes.
"""

from __future__ import annotations

import asyncio
import inspect
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Self

from aiohttp import web

from gateway.app import GatewaySettings, connect, start
from gateway.records import Outcome, task_for_label
from gateway.service import Gateway
from gateway.sessions import SessionLimits
from sciproto.client.rollouts import RolloutGroup, RolloutStatus

__all__ = ["Agent", "LocalGateway"]

Agent = Callable[[str], float | Awaitable[float]]


class LocalGateway:
    """A gateway served on a free loopback port of this process, without auth."""

    def __init__(self, policies: Sequence[str], limits: SessionLimits | None = None,
                 rollouts_file: Path | None = None, adapter: str = "") -> None:
        self.settings = GatewaySettings(policies=list(policies), host="127.0.0.1", port=0,
                                        limits=limits or SessionLimits(), rollouts_file=rollouts_file,
                                        adapter=adapter)
        self.gateway: Gateway | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def __aenter__(self) -> Self:
        self.gateway = await connect(self.settings)
        self._runner, self.port = await start(self.gateway, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        for client in self.gateway.policies if self.gateway else ():
            await client.close()

    @property
    def model(self) -> str:
        assert self.gateway is not None, "use LocalGateway in `async with`"
        return self.gateway.model_names[0]

    def base_url(self, session: str) -> str:
        return f"http://127.0.0.1:{self.port}/s/{session}/v1"

    async def run_group(self, agent: Agent, label: str, size: int) -> RolloutGroup:
        """Run `agent` `size` times concurrently, one session each, and return their group."""
        assert self.gateway is not None, "use LocalGateway in `async with`"
        gateway = self.gateway

        async def one(sample: int) -> None:
            session = f"run{sample}-{uuid.uuid4().hex[:12]}"
            try:
                if inspect.iscoroutinefunction(agent):
                    reward = await agent(self.base_url(session))
                else:
                    reward = await asyncio.to_thread(agent, self.base_url(session))
                outcome = Outcome(label, float(reward))  # type: ignore[arg-type]
            except Exception as error:  # noqa: BLE001 -- an agent's failure is recorded, never trained on
                outcome = Outcome(label, 0.0, RolloutStatus.INFRA_ERROR, f"{type(error).__name__}: {error}")
            if session in gateway.store.sessions:
                await gateway.close_session(session, "", outcome)
            else:
                gateway.record_failure(session, outcome if outcome.error else Outcome(
                    label, 0.0, RolloutStatus.INFRA_ERROR, "the agent returned without calling the model"))

        await asyncio.gather(*(one(sample) for sample in range(size)))
        taken, released = gateway.take(label, last=True)
        if released:
            raise RuntimeError(f"{released} record(s) of group {label!r} were released from memory past "
                               f"{gateway.store.limits.max_held_records} held records (they are in "
                               f"{gateway.rollouts_file}); raise SessionLimits.max_held_records")
        records = sorted(taken, key=lambda record: record.sample)
        return RolloutGroup(task_for_label(label), records)
