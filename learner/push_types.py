"""What every weight pusher shares: the result of one push and the interface the learner calls.

Its own module so that the pushers (`learner.weight_push`, `learner.collective_push`,
`learner.vllm_sync`) import it, and `learner.weight_push`, which chooses among them, imports
them without any of them importing it back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch
from pydantic import BaseModel


class PushResult(BaseModel):
    """One push to every policy server."""

    policy_version: int
    seconds: float
    servers: int


class WeightPusher(Protocol):
    """Sends new weights to every configured policy server."""

    async def serving_versions(self) -> list[int]:
        """The policy version each server serves now (Describe), in target order."""
        ...

    async def push(self, state_dict: Mapping[str, torch.Tensor], version: int) -> PushResult:
        """Make every server serve `state_dict` as `version` (greater than what they serve);
        raises the first failure once every push has ended."""
        ...

    async def aclose(self) -> None: ...


class ReconcilingPusher(WeightPusher, Protocol):
    """A pusher that can also reach servers one by one, so the learner can bring a server that
    fell behind (restarted, or missed a push) up to date without touching the others."""

    async def versions_each(self, timeout_s: float) -> list[int | None]:
        """Each target's serving version, None where it cannot be reached now."""
        ...

    async def push_to(
        self, indices: Sequence[int], state_dict: Mapping[str, torch.Tensor], version: int
    ) -> PushResult:
        """Push to the targets at `indices` only."""
        ...


__all__ = ["PushResult", "ReconcilingPusher", "WeightPusher"]
