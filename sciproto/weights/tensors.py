"""Tensors in a weight update: their specs (name, shape, dtype) and the checks a receiver runs
before it touches any weight."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads when a dtype is looked up: reading a config does not need it
    import torch


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype (torch name without the "torch." prefix, e.g. "bfloat16")."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class WeightUpdateManifest:
    """Header of a weight update: the version it installs and the tensors it carries."""

    version: int
    tensors: list[TensorSpec]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype name (e.g. float32, bfloat16)")  # noqa: TRY004 -- bad request content
    return dtype


def validate_weight_update(manifest: list[TensorSpec], tensors: Mapping[str, torch.Tensor]) -> None:
    """Raise ValueError naming the first tensor that is missing, unexpected, or of the wrong
    shape or dtype. A backend calls this before it touches any weight."""
    expected = {spec.name: spec for spec in manifest}
    missing = sorted(expected.keys() - tensors.keys())
    if missing:
        raise ValueError(f"weight update is missing tensor {missing[0]!r} ({len(missing)} missing)")
    extra = sorted(tensors.keys() - expected.keys())
    if extra:
        raise ValueError(f"weight update has unexpected tensor {extra[0]!r} ({len(extra)} extra)")
    for name, spec in expected.items():
        tensor = tensors[name]
        if tuple(tensor.shape) != spec.shape:
            raise ValueError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {spec.shape}"
            )
        if dtype_name(tensor.dtype) != spec.dtype:
            raise ValueError(
                f"tensor {name!r} has dtype {dtype_name(tensor.dtype)}, expected {spec.dtype}"
            )


__all__ = ["TensorSpec", "WeightUpdateManifest", "dtype_from_name", "dtype_name", "validate_weight_update"]
