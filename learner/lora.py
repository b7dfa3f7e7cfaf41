"""LoRA training in the learner (`learner.lora`): a frozen base model with a PEFT adapter, of
which only the adapter trains, is pushed and is checkpointed.

    base W (frozen, fp32)      y = W x + (alpha / rank) * B A x      A, B: fp32 masters, in AdamW

`LoraWeights.wrap` injects the adapter with `peft.get_peft_model`. The trainer forwards through
the base model itself (`LoraWeights.model`, the transformers model whose targeted linears PEFT
replaced in place), so everything that reads a transformers model (the shared-prefix cache, the
input embeddings) works as with full weights; the PEFT wrapper names the adapter's tensors as the
wire carries them (`sciproto.lora`) and switches the adapter off for the KL reference.

What does not combine with LoRA here is refused in one line (learner/lora_limits.py): FSDP2
(several learner ranks), the fp8 precisions (their linears and PEFT's would wrap each other), and
the collective push transports (adapters travel as UpdateWeights chunks). PEFT is imported when an
adapter is built, so that reading a learner config does not load it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from sciproto.client.policy import distinct_tensors
from sciproto.config import ConfigError
from sciproto.lora import LoraSpec
from sciproto.weights.wire import set_digest, tensor_digests


def base_digest(model: nn.Module) -> bytes:
    """The XXH3 set digest (`sciproto.weights.wire.set_digest`) of a model's weights as its state
    dict names them, aliases once: the base's identity in a LoRA checkpoint (about 30 ms for the
    135M-parameter SmolLM2 in fp32)."""
    tensors = distinct_tensors({name: tensor.detach().cpu() for name, tensor in model.state_dict().items()})
    return set_digest(tensor_digests(tensors))


class LoraWeights:
    """A base model wrapped with one trainable LoRA adapter."""

    def __init__(self, peft_model: nn.Module, spec: LoraSpec, base_name: str, digest: bytes) -> None:
        self.peft_model = peft_model
        self.spec = spec
        self.base_name = base_name
        self.base_digest = digest
        # The base model with the adapter's linears in place: what the trainer forwards.
        self.model: nn.Module = peft_model.base_model.model

    @classmethod
    def wrap(cls, model: nn.Module, spec: LoraSpec, base_name: str = "") -> LoraWeights:
        """Freeze `model` and inject the adapter (in place; A drawn from torch's generator, B zero,
        so the wrapped model starts as the base)."""
        from peft import get_peft_model

        digest = base_digest(model)
        peft_model = get_peft_model(model, spec.peft_config())
        return cls(peft_model, spec, base_name, digest)

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def summary(self) -> str:
        count = sum(p.numel() for p in self.trainable())
        total = sum(p.numel() for p in self.model.parameters())
        return (f"LoRA adapter {self.spec.name!r} (rank {self.spec.rank}, alpha {self.spec.alpha:g}, "
                f"{'/'.join(self.spec.target_modules)}; {count:,} of {total:,} parameters train)")

    def state_dict(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The adapter's tensors on CPU in `dtype`, named as PEFT saves them (and as the wire
        carries them): copies, the masters untouched."""
        from peft import get_peft_model_state_dict

        tensors = get_peft_model_state_dict(self.peft_model, save_embedding_layers=False)
        return {name: tensor.detach().to("cpu", dtype, copy=True) for name, tensor in tensors.items()}

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy saved adapter tensors into the adapter, in place; ValueError names a missing or
        unexpected one."""
        from peft import get_peft_model_state_dict, set_peft_model_state_dict

        expected = set(get_peft_model_state_dict(self.peft_model, save_embedding_layers=False))
        if set(tensors) != expected:
            name = next(iter(sorted(expected ^ set(tensors))))
            raise ValueError(f"the adapter's tensors do not match {self.spec.name!r}: {name!r} is "
                             f"{'missing' if name in expected else 'not one of them'}")
        with torch.no_grad():
            set_peft_model_state_dict(self.peft_model, dict(tensors))

    @contextlib.contextmanager
    def base_only(self) -> Iterator[None]:
        """Forwards inside run the base alone (the adapter switched off): the KL reference."""
        with self.peft_model.disable_adapter():
            yield

    def identity(self) -> dict[str, Any]:
        """What a checkpoint of this adapter must match to resume: the adapter and its base."""
        return {"spec": self.spec.model_dump(mode="json"), "base_model": self.base_name,
                "base_digest": self.base_digest.hex()}

    def check_identity(self, saved: Mapping[str, Any] | None, where: str) -> None:
        """ConfigError, one line, unless checkpoint `where` holds an adapter of this spec over
        these base weights."""
        if saved is None:
            raise ConfigError(f"{where} holds full weights, not a LoRA adapter; this learner trains adapter "
                              f"{self.spec.name!r}: resume it with learner.lora unset, or use another run_dir")
        spec = LoraSpec.model_validate(saved["spec"])
        if spec != self.spec:
            fields = [f"{key} {getattr(spec, key)!r} (config: {getattr(self.spec, key)!r})"
                      for key in LoraSpec.model_fields if getattr(spec, key) != getattr(self.spec, key)]
            raise ConfigError(f"{where} holds a LoRA adapter of another spec: {', '.join(fields)}; set learner.lora "
                              "as the checkpoint's, or use another run_dir")
        if saved["base_digest"] != self.base_digest.hex():
            raise ConfigError(f"{where} holds an adapter of base {saved['base_model']!r} (weights digest "
                              f"{saved['base_digest']}), not of this learner's {self.base_name!r} (digest "
                              f"{self.base_digest.hex()}); set learner.model as the run's, or use another run_dir")


__all__ = ["LoraWeights", "base_digest"]
