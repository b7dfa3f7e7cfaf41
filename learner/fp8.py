"""FP8 training of the linear layers with torchao's float8 (dynamic rowwise scaling).

Each converted linear casts its input, weight and output gradient to float8_e4m3fn with one
scale per row (power-of-two scales), x_fp8 = cast(x * s), s = 448 / amax(|x_row|), and runs the
matmul in FP8 with high-precision accumulation. The layer's weight stays the fp32 master
(learner/precision.py) and is cast to FP8 in each forward. Real FP8 matmuls need a CUDA GPU with
compute capability >= 8.9 (Ada/Hopper); `emulate=True` runs the same casts and scales with
high-precision matmuls on any device, so the numerics are tested on CPU.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch
from torch import nn

FP8_MIN_CAPABILITY = (8, 9)


class FP8UnavailableError(RuntimeError):
    """FP8 training was asked for on a machine that cannot run FP8 matmuls."""


def require_fp8_hardware() -> None:
    """Raise unless a CUDA device with compute capability >= 8.9 is present; never falls back."""
    if not torch.cuda.is_available():
        raise FP8UnavailableError(
            "precision 'fp8' needs a CUDA GPU with compute capability >= 8.9 (Ada or Hopper), "
            "and this machine has no CUDA device; use precision 'bf16', or 'fp8-emulated' to "
            "test the FP8 numerics on CPU"
        )
    capability = torch.cuda.get_device_capability()
    if capability < FP8_MIN_CAPABILITY:
        raise FP8UnavailableError(
            f"precision 'fp8' needs compute capability >= 8.9 (Ada or Hopper); "
            f"{torch.cuda.get_device_name()} has {capability[0]}.{capability[1]}; "
            f"use precision 'bf16'"
        )


def _import_torchao_float8() -> tuple[type, Callable[..., nn.Module]]:
    # torchao logs a warning for each optional CUDA kernel library it cannot load; float8
    # training does not use them (its matmul is torch._scaled_mm).
    logging.getLogger("torchao").setLevel(logging.ERROR)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as error:
        raise FP8UnavailableError(
            "precision 'fp8' needs torchao: pip install 'torchao>=0.18'"
        ) from error
    return Float8LinearConfig, convert_to_float8_training


def is_fp8_eligible(module: nn.Module, name: str) -> bool:
    """Linear layers whose dims FP8 matmuls accept (multiples of 16), except the output head.

    The head (lm_head) stays in high precision: its logits feed the logprobs that the loss and
    the importance weights compare across policies.
    """
    if not isinstance(module, nn.Linear) or name.split(".")[-1] == "lm_head":
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert_to_fp8(model: nn.Module, *, emulate: bool = False) -> nn.Module:
    """Swap eligible nn.Linear layers for torchao Float8Linear (rowwise recipe), in place.

    Without `emulate` this checks for FP8 hardware first and raises FP8UnavailableError.
    Parameter names are unchanged, so state dicts and weight pushes are unaffected.
    """
    if not emulate:
        require_fp8_hardware()
    float8_config_type, convert = _import_torchao_float8()
    config = dataclasses.replace(float8_config_type.from_recipe_name("rowwise"), emulate=emulate)
    converted = convert(model, module_filter_fn=is_fp8_eligible, config=config)
    if count_fp8_linears(converted) == 0:
        raise ValueError(
            "convert_to_fp8 found no nn.Linear with in/out features divisible by 16 to convert"
        )
    return converted


def count_fp8_linears(model: nn.Module) -> int:
    return sum(type(m).__name__ == "Float8Linear" for m in model.modules())

