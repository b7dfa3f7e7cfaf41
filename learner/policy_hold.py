"""Colocated placement, the learner's side: generation is held on every policy server while an
optimizer step and its push run, so that the step has all of the machine's cores.

    step:  Hold(all policy servers) -> train_step -> push -> release

Each hold is one `PolicyService.Hold` call (protocol 1.5): its first answer comes once the server's
engine is idle, and leaving the block releases it. The windows come back in the servers' own wall
clock, and the step's metrics record them beside the learner's (`policy_held_s`, and the bounds the
colocated test checks: no forward pass of any server overlaps the step). A server that cannot be
held in time is logged and left running: the step goes on, sharing the cores as the disaggregated
layout does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from sciproto.channel import ServerAccess
from sciproto.client.policy import HoldWindow, PolicyClient
from sciproto.errors import SciprotoError, first_line

log = logging.getLogger("learner.service")


@dataclass
class HeldStep:
    """The holds of one step: each server's window (None where the hold failed) and the
    learner's own wall clock around the work it held for."""

    windows: list[HoldWindow | None] = field(default_factory=list)
    work_from: float = 0.0
    work_until: float = 0.0

    def record(self) -> dict[str, float | None]:
        """The step-metrics fields: seconds held (the longest window), and the bounds all servers
        were held within (server clocks) against the learner's work (its clock)."""
        held = [w for w in self.windows if w is not None and w.released_at]
        if not held:
            return {"policy_held_s": 0.0}
        return {
            "policy_held_s": max(w.released_at - w.held_at for w in held),
            "policy_held_from_unix_s": max(w.held_at for w in held),
            "policy_held_until_unix_s": min(w.released_at for w in held),
            "step_work_from_unix_s": self.work_from,
            "step_work_until_unix_s": self.work_until,
        }


class PolicyHold:
    """Holds `targets` (a list the learner retargets in place) around each step."""

    def __init__(self, targets: list[str], access: ServerAccess | None, timeout_s: float,
                 max_seconds: float) -> None:
        self._targets = targets
        self._access = access or ServerAccess()
        self._timeout_s = timeout_s
        self._max_seconds = max_seconds
        self._clients: dict[str, PolicyClient] = {}

    def _client(self, target: str) -> PolicyClient:
        if target not in self._clients:
            self._clients[target] = PolicyClient(self._access.channel(target))
        return self._clients[target]

    @contextlib.asynccontextmanager
    async def step(self, step: int) -> AsyncIterator[HeldStep]:
        """Hold every server for the block; the HeldStep's windows are complete after it."""
        targets = list(self._targets)
        held = HeldStep(windows=[None] * len(targets))
        holds = [self._client(target).hold(self._max_seconds, f"learner step {step}", self._timeout_s)
                 for target in targets]

        async def enter(index: int) -> None:
            try:
                held.windows[index] = await holds[index].__aenter__()
            except (SciprotoError, TimeoutError, RuntimeError) as error:
                log.warning("could not hold generation on %s for step %d (%s); the step shares the cores",
                            targets[index], step, first_line(error))

        async def leave(index: int) -> None:
            if held.windows[index] is None:
                return
            try:
                await holds[index].__aexit__(None, None, None)
            except (SciprotoError, TimeoutError, RuntimeError) as error:  # the server released it or is gone
                log.warning("the hold of %s for step %d ended badly (%s)", targets[index], step, first_line(error))

        await asyncio.gather(*(enter(i) for i in range(len(targets))))
        held.work_from = time.time()
        try:
            yield held
        finally:
            held.work_until = time.time()
            await asyncio.shield(asyncio.gather(*(leave(i) for i in range(len(targets)))))

    async def aclose(self) -> None:
        await asyncio.gather(*(client.close() for client in self._clients.values()), return_exceptions=True)


def policy_hold(targets: list[str], access: ServerAccess | None, timeout_s: float, max_seconds: float,
                enabled: bool) -> PolicyHold | None:
    return PolicyHold(targets, access, timeout_s, max_seconds) if enabled and targets else None


__all__ = ["HeldStep", "PolicyHold", "policy_hold"]
