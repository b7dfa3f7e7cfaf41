"""The interface every policy backend implements; the gRPC service talks only to this."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Protocol, runtime_checkable

import torch

from policy_server.types import (
    AdapterState,
    BackendInfo,
    GenerationRequest,
    SampleResult,
    TensorSpec,
    TokenDelta,
)
from sciproto.lora import LoraSpec

# What every in-process backend (transformers, vllm) offers, as Describe lists it.
CAPABILITIES = [
    "chat",
    "prompt_token_ids",
    "tool_calls",
    "logprobs",
    "multi_turn_token_ids",
    "n_samples",
    "seed",
    "stop_strings",
    "weight_updates",
    "version_spans",
]

# A backend that takes collective-transport weight updates (WEIGHT_TRANSPORT_COLLECTIVE) reports
# these: the capability's name, then its name before protocol 1.3, kept for a release.
COLLECTIVE_CAPABILITIES = ["weight_updates_collective", "weight_updates_nccl"]


@runtime_checkable
class PolicyBackend(Protocol):
    def info(self) -> BackendInfo:
        """Model, backend, dtype, context, current policy version, capabilities."""
        ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta | SampleResult]:
        """TokenDeltas while sampling and one SampleResult per sample when it ends (samples of
        one request may interleave). Bad requests raise ValueError before anything is yielded."""
        ...

    def weight_manifest(self) -> list[TensorSpec]:
        """The tensors an update must carry, exactly."""
        ...

    async def update_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Validate against the manifest (a missing, extra, mis-shaped or mis-typed tensor raises
        ValueError naming it, and nothing changes), then install the weights in place between
        decode steps and make `version` the policy version."""
        ...

    async def close(self) -> None:
        """Finish running samples with finish reason "abort" and release the model."""
        ...


@runtime_checkable
class HoldBackend(Protocol):
    """A backend whose generation can be held (protocol 1.5, `PolicyService.Hold`): while a hold is
    open no forward pass runs; running samples freeze between two decode steps and new requests
    wait; weight and adapter updates still apply. Holds nest: generation runs again when the last
    one is released."""

    async def hold(self) -> tuple[float, int]:
        """Open a hold; returns once the engine is idle, with the wall-clock time (time.time())
        from which no forward pass runs and the number of Generate requests it froze."""
        ...

    async def release(self) -> float:
        """Close one hold; returns the wall-clock time from which generation may run again
        (when no other hold is open)."""
        ...


@runtime_checkable
class AdapterBackend(Protocol):
    """A backend that serves LoRA adapters beside its base weights (protocol 1.4). `generate`
    samples a request whose `adapter` names one with it, and stamps its version spans with that
    adapter's versions; a request naming none samples the base weights."""

    max_adapters: int  # most adapters held at once
    max_adapter_rank: int  # highest rank taken; 0: any

    def adapters(self) -> dict[str, AdapterState]:
        """The adapters held now, by name."""
        ...

    def adapter_manifest(self, spec: LoraSpec) -> list[TensorSpec]:
        """The tensors an update of `spec` must carry, exactly (sciproto.lora.adapter_tensor_specs);
        ValueError says what in the spec this model cannot take."""
        ...

    async def update_adapter(self, spec: LoraSpec, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Validate against `adapter_manifest(spec)` (ValueError naming the tensor; nothing changes),
        then add the adapter, or replace the one of that name, between decode steps; the base
        weights and every other adapter stay as they are. Samples running with the adapter go on
        with the new one, their version spans saying so."""
        ...
