"""Where the learner and the policy servers' receiving ranks meet for collective weight updates.

A configuration model only, without torch, so that reading a policy server's configuration (as
`sciproto train` does before it starts anything) does not import torch; the group itself is
`sciproto.weights.group`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from sciproto.units import MiB


class CollectiveRendezvous(BaseModel):
    """Where the learner (rank 0, which hosts the store) and the policy servers' receiving ranks
    meet. The learner's `nccl:` section and each server's `weights.collective`
    hold the same values except `rank_offset`, which only servers read."""

    model_config = ConfigDict(extra="forbid")

    master_address: str = Field(description="Host of the learner, reachable from every policy server")
    master_port: int = Field(gt=0, lt=65536, description="Free TCP port on that host for the rendezvous")
    world_size: int = Field(ge=2, description="1 (the learner) + every receiving rank of every server")
    rank_offset: int = Field(1, ge=1, description="Rank of this server's first receiving rank")
    # Packed: tensors travel in a few large buffers instead of one broadcast each (vLLM's default
    # on the trainer side); both ends must agree, so both read it from this same model.
    packed: bool = True
    buffer_bytes: int = Field(64 * MiB, ge=1, description="Bytes per broadcast on the gloo group")
    timeout_s: float = Field(120.0, gt=0, description="Longest wait of any one step: store, group, broadcast")

    def worker_init_info(self) -> dict[str, Any]:
        """The `init_info` of vLLM's NCCL engine (NCCLWeightTransferInitInfo) for this server."""
        return {
            "master_address": self.master_address,
            "master_port": self.master_port,
            "rank_offset": self.rank_offset,
            "world_size": self.world_size,
            "packed": self.packed,
        }
