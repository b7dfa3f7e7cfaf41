"""Mixed precision with fp32 master weights: `precision` says how the forward computes, never how
the weights and the optimizer state are stored.

    precision     stored weights + AdamW state    forward matmuls
    fp32          fp32                            fp32
    bf16          fp32                            bf16 (autocast; FSDP2: bf16 gathered copies)
    fp8           fp32                            FP8 linears (torchao, learner/fp8.py), bf16 elsewhere
    fp8-emulated  fp32                            the same FP8 casts with high-precision matmuls

An update of lr 1e-6 moves a weight of ~0.02 by ~1e-6, far below bf16's spacing there (~1.2e-4):
stored in bf16 it would round to nothing. fp32 masters keep every update; the policy servers get
the weights in the dtype they serve (`GRPOTrainer.push_dtype`), rounded once per push.

One process: the forward runs under `torch.autocast(device, bfloat16)` (matmuls in bf16, norms and
softmax in fp32). Under FSDP2: `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` gathers
bf16 copies of the fp32 shards for the forward and backward and reduces gradients in fp32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from learner.fp8 import convert_to_fp8, require_fp8_hardware

PRECISIONS = ("fp32", "bf16", "fp8", "fp8-emulated")


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype of the forward's matmuls outside FP8 linears: fp32 for fp32, bf16 otherwise
    (rowwise-scaled FP8 matmuls take bf16 operands)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    return torch.float32 if precision == "fp32" else torch.bfloat16


def prepare_model(model: nn.Module, precision: str) -> nn.Module:
    """fp32 master weights; fp8 (CUDA >= 8.9 only) and fp8-emulated swap eligible linears for
    torchao's Float8Linear, whose weights stay fp32 and are cast to FP8 inside each matmul."""
    compute_dtype(precision)  # a clear error for an unknown name
    model = model.float()
    if precision == "fp8":
        require_fp8_hardware()
        return convert_to_fp8(model)
    if precision == "fp8-emulated":
        return convert_to_fp8(model, emulate=True)
    return model


def fsdp_policy(precision: str) -> MixedPrecisionPolicy:
    """FSDP2's mixed precision: compute in `compute_dtype`, reduce gradients in fp32 (fp32: FSDP2's
    default, which casts nothing)."""
    if compute_dtype(precision) == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=compute_dtype(precision), reduce_dtype=torch.float32)


@contextlib.contextmanager
def autocast(precision: str, device_type: str, *, sharded: bool) -> Iterator[None]:
    """Around a forward in one process: bf16 autocast unless precision is fp32. Under FSDP2
    (`sharded`) the MixedPrecisionPolicy already gives the forward bf16 weights: no autocast."""
    if sharded or compute_dtype(precision) == torch.float32:
        yield
        return
    with torch.autocast(device_type, dtype=compute_dtype(precision)):
        yield


__all__ = ["PRECISIONS", "autocast", "compute_dtype", "fsdp_policy", "prepare_model"]
