"""LoRA adapters on the wire (protocol 1.4): what an adapter is, and the tensors an update of it
carries.

An adapter adds (alpha / rank) * B A x to the output of each linear layer it targets, with A of
shape (rank, in_features) and B of shape (out_features, rank). Its tensors travel named as PEFT
saves them (`adapter_model.safetensors`): `base_model.model.<module>.lora_A.weight` and
`...lora_B.weight`, so a receiver can hand them to PEFT or to vLLM's LoRA loader as they are, and
an adapter trained anywhere with PEFT can be pushed unchanged.

Public API: `LoraSpec`, `linear_layers`, `adapter_tensor_specs`, `ADAPTER_PREFIX`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sciproto.weights.tensors import TensorSpec

if TYPE_CHECKING:  # torch loads when a model is read: a config with an adapter does not need it
    from torch import nn

ADAPTER_PREFIX = "base_model.model."  # PEFT's prefix of a saved adapter's tensor names
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class LoraSpec(BaseModel):
    """One adapter: its name and shape. `dropout` applies while training only and never travels."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field("lora", description="The adapter's name; Generate and the gateway select it by it")
    rank: int = Field(8, ge=1, le=1024, description="Rank r of A (r x in) and B (out x r)")
    alpha: float = Field(16.0, gt=0, description="The adapter adds (alpha / rank) * B A x")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input while training")
    target_modules: tuple[str, ...] = Field(
        ("q_proj", "k_proj", "v_proj", "o_proj"),
        min_length=1,
        description="Linear layers the adapter wraps, by the last part of their module name",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not _NAME.fullmatch(name):
            raise ValueError(f"adapter name {name!r}: use 1-64 characters of [A-Za-z0-9._-], starting with a "
                             "letter or digit")
        return name

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def to_proto(self) -> Any:
        from sciproto.pb import policy_pb2

        return policy_pb2.LoraAdapter(name=self.name, rank=self.rank, alpha=self.alpha,
                                      target_modules=list(self.target_modules))

    @classmethod
    def from_proto(cls, message: Any) -> LoraSpec:
        """The spec of a LoraAdapter message; ValueError says which field is wrong."""
        return cls(name=message.name, rank=message.rank, alpha=message.alpha,
                   target_modules=tuple(message.target_modules))

    def peft_config(self) -> Any:
        """PEFT's LoraConfig of this adapter (bias none, as the wire carries A and B only)."""
        from peft import LoraConfig

        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=list(self.target_modules), bias="none")

    def adapter_config(self, base_model: str) -> dict[str, Any]:
        """The `adapter_config.json` PEFT and vLLM read beside the tensors."""
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.rank, "lora_alpha": self.alpha,
                "lora_dropout": 0.0, "target_modules": list(self.target_modules), "bias": "none",
                "base_model_name_or_path": base_model, "fan_in_fan_out": False, "modules_to_save": None,
                "use_rslora": False, "use_dora": False}


def linear_layers(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Module name -> (out_features, in_features) of every nn.Linear of a base model (a meta-device
    model will do: only shapes are read)."""
    from torch import nn

    return {name: (module.out_features, module.in_features)
            for name, module in model.named_modules() if isinstance(module, nn.Linear)}


def adapter_tensor_specs(layers: Mapping[str, tuple[int, int]], spec: LoraSpec, dtype: str) -> list[TensorSpec]:
    """Exactly the tensors an update of `spec` carries for a model with these linear layers, in
    module order, A before B. ValueError names a target module that matches no linear layer."""
    specs: list[TensorSpec] = []
    matched: set[str] = set()
    for name, (out_features, in_features) in layers.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in spec.target_modules:
            continue
        matched.add(leaf)
        specs.append(TensorSpec(f"{ADAPTER_PREFIX}{name}.lora_A.weight", (spec.rank, in_features), dtype))
        specs.append(TensorSpec(f"{ADAPTER_PREFIX}{name}.lora_B.weight", (out_features, spec.rank), dtype))
    missing = [module for module in spec.target_modules if module not in matched]
    if missing:
        leaves = sorted({name.rsplit(".", 1)[-1] for name in layers})
        raise ValueError(f"adapter {spec.name!r} targets {missing[0]!r}, which is no linear layer of this model; "
                         f"its linear layers are named {', '.join(leaves)}")
    return specs


__all__ = ["ADAPTER_PREFIX", "LoraSpec", "adapter_tensor_specs", "linear_layers"]
