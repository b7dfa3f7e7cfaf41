"""What a LoRA adapter (`learner.lora`) does not combine with in the learner, each refused in one
line: FSDP2 (several learner ranks), the fp8 precisions (their linears and PEFT's would wrap each
other), and the collective push transports (adapters travel as UpdateWeights chunks). Free of
torch, so that a config is checked before anything heavy loads."""

from __future__ import annotations

from typing import Any

from sciproto.config import ConfigError
from sciproto.lora import LoraSpec


def refusal(spec: LoraSpec | None, *, precision: str = "fp32", push_transport: str = "grpc",
            world_size: int = 1) -> str | None:
    """Why `spec` cannot train with these settings (one line), or None when it can."""
    if spec is None:
        return None
    if precision in ("fp8", "fp8-emulated"):
        return (f"learner.lora with grpo.precision {precision}: the FP8 linears and the adapter's would wrap "
                "each other; use precision bf16 or fp32 with a LoRA adapter")
    if push_transport != "grpc":
        return (f"learner.lora with push_transport {push_transport}: an adapter travels as UpdateWeights "
                "chunks; use push_transport grpc (the adapter's tensors are small)")
    if world_size > 1:
        return (f"learner.lora on {world_size} learner ranks: LoRA trains on one rank here, not under FSDP2; "
                "run one learner rank (the adapter's gradients are small) or leave learner.lora unset")
    return None


def refuse_unsupported(spec: LoraSpec | None, **settings: Any) -> None:
    """ConfigError with `refusal`'s line, if any."""
    reason = refusal(spec, **settings)
    if reason is not None:
        raise ConfigError(reason)


__all__ = ["refusal", "refuse_unsupported"]
