"""Data-parallel training under torchrun with FSDP2 (`fully_shard`); a no-op in one process.

Every rank calls `GRPOTrainer.train_step` with the same groups (rank 0 may `broadcast_groups`
them first); each rank trains on its own slice of the sequences and FSDP2 reduces the gradients.
FSDP2 runs on CPU with the gloo backend as well as on CUDA with NCCL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from learner.types import RolloutGroup


@dataclass(frozen=True)
class DistributedContext:
    rank: int
    world_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def current_context() -> DistributedContext:
    if dist.is_available() and dist.is_initialized():
        return DistributedContext(rank=dist.get_rank(), world_size=dist.get_world_size())
    return DistributedContext(rank=0, world_size=1)


def shard_model(
    model: nn.Module, device_type: str, mp_policy: MixedPrecisionPolicy | None = None
) -> nn.Module:
    """FSDP2: shard every repeated block (the items of each nn.ModuleList), then the root.

    Sharding blocks separately lets FSDP2 gather one block's weights at a time. The shards keep
    the model's dtype (the fp32 masters); `mp_policy` sets the dtype of the gathered copies the
    forward computes with and of the gradient reduction (learner/precision.py).
    """
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    policy = mp_policy or MixedPrecisionPolicy()
    for module_list in [m for m in model.modules() if isinstance(m, nn.ModuleList)]:
        for block in module_list:
            fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded weights on CPU, named as in `model.state_dict()`; empty on ranks other than 0.

    Collective under FSDP2: every rank must call it.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    return _tied(model, weights) if weights else weights


def _tied(model: nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Names of one parameter (tied weights: an LM head tied to the embeddings) as one tensor, as
    `model.state_dict()` gives them in one process; the gathered state dict copies each apart.
    A weight push sends each tensor once, and a policy server refuses a tied name sent apart."""
    first: dict[int, str] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if name not in weights:
            continue
        owner = first.setdefault(id(parameter), name)
        if owner != name:
            weights[name] = weights[owner]
    return weights


def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType) -> torch.Tensor:
    """In place across ranks (no-op in one process); NCCL reduces a CUDA copy of CPU tensors."""
    if not current_context().is_distributed:
        return tensor
    if dist.get_backend() == "nccl" and tensor.device.type != "cuda":
        on_device = tensor.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(on_device, op=op)
        return tensor.copy_(on_device)
    dist.all_reduce(tensor, op=op)
    return tensor


def broadcast_groups(groups: list[RolloutGroup] | None, src: int = 0) -> list[RolloutGroup]:
    """Give every rank the groups that rank `src` holds (other ranks pass None)."""
    context = current_context()
    if not context.is_distributed:
        if groups is None:
            raise ValueError("broadcast_groups in one process needs the groups themselves")
        return groups
    payload = [[g.model_dump() for g in groups] if context.rank == src else None]
    dist.broadcast_object_list(payload, src=src)
    return [RolloutGroup.model_validate(g) for g in payload[0]]
