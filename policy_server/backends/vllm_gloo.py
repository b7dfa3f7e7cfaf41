"""vLLM's weight-transfer engine for the CPU: the learner's gloo group (`sciproto.weights.group`)
inside vLLM's own update path.

vLLM's built-in transfer engines (nccl, ipc, ...) need CUDA. This one takes part in the same
gloo group as the transformers backend's servers, with the same rules (the learner is rank 0 and
names each group in its store; tensors travel as the bytes of the UpdateWeights header, in header
order), and it runs where vLLM runs its own engines: in each worker, between
`start_weight_update` and `finish_weight_update`, with vLLM's layerwise reload around the loading,
so an update on the CPU follows exactly the flow of an NCCL update on a GPU.

vLLM finds it by name (`weight_transfer_config.backend`, `GLOO_TRANSFER_BACKEND`) in its engine
registry, which every vLLM process fills from the `vllm.general_plugins` entry point
`sciproto_gloo` (pyproject.toml) before it builds a worker: `register` below.

This module imports vLLM: only vLLM's processes load it (through the entry point).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from policy_server.backends.vllm_backend import GLOO_TRANSFER_BACKEND
from policy_server.types import TensorSpec
from sciproto.weights.group import WeightGroup
from sciproto.weights.rendezvous import CollectiveRendezvous
from sciproto.weights.wire import DigestMismatch, verify_tensor_digests

log = logging.getLogger(__name__)


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """The server's `CollectiveRendezvous`, as `model_dump()` gives it."""

    rendezvous: dict


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One update: the header's tensors, in header order."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    # TensorSpec.digest of each tensor, hex, in the same order; empty: not checked
    digests: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"update_info lists {len(self.names)} names, {len(self.dtype_names)} dtypes and "
                             f"{len(self.shapes)} shapes; they must be the same length")
        if self.digests and len(self.digests) != len(self.names):
            raise ValueError(f"update_info lists {len(self.digests)} digests for {len(self.names)} tensors")


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Receives one update over the gloo group and loads it into this worker's model."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.group: WeightGroup | None = None
        self.failure = ""  # why the last transfer failed before loading; the backend takes it
        self.failure_tensor = ""  # the tensor whose digest did not match, when that was why

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        """Remember the rendezvous; the group itself forms on the first update (the learner opens
        it while the update's header is in flight)."""
        rendezvous = CollectiveRendezvous(**init_info.rendezvous)
        config = self.parallel_config
        # one receiving rank per worker, across data-parallel replicas, as vLLM's NCCL engine counts
        worker = config.data_parallel_index * config.world_size + config.rank
        self.group = WeightGroup(rendezvous, rank=rendezvous.rank_offset + worker)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        repack_tied_linears(self.model)

    def update_weights(self, update_info: dict) -> None:
        # The base class synchronizes an accelerator after receiving; on the CPU there is none.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("the gloo weight transfer is not initialized: call init_weight_transfer_engine first")
        specs = [TensorSpec(name, tuple(shape), dtype)
                 for name, dtype, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes)]
        try:
            self.group.form()
            tensors = self.group.receive(specs)  # all of them, before the model is touched
        except Exception as error:  # noqa: BLE001 -- reported through take_transfer_failure
            # Nothing reached the model. Raising here would make vLLM's worker drop the update
            # session with every layer still mid-reload; returning lets the backend end the
            # session, which puts back the old weights of every layer that loaded nothing.
            self.group.discard()  # the learner names a new group on its next push
            self.failure = f"{type(error).__name__}: {error}"
            return
        try:  # the bytes received, before any reaches the model
            verify_tensor_digests([(name, bytes.fromhex(digest))
                                   for name, digest in zip(update_info.names, update_info.digests)], tensors)
        except DigestMismatch as error:
            self.failure, self.failure_tensor = f"{error}", error.tensor
            return
        self.model.load_weights((name, tensor.to(self.device)) for name, tensor in tensors.items())

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


def repack_tied_linears(model: torch.nn.Module) -> None:
    """On the CPU, vLLM runs each linear layer from a packed copy of its weight (oneDNN or its
    own small-GEMM kernels) made when the weights are processed. The layerwise reload processes
    each layer it loads, but a tied weight is loaded through one layer only (the embedding), so
    the other (the LM head of a model with tied embeddings, SmolLM2 and `tiny` among them) would
    keep sampling from its packed copy of the old weight. A linear layer that still holds its
    weight (the packing frees it otherwise) is packed again from the weight it now shares."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and weight is not None and weight.numel() and not weight.is_meta:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)


def register() -> None:
    """The `vllm.general_plugins` entry point: every vLLM process calls it at start-up."""
    try:
        WeightTransferEngineFactory.register_engine(GLOO_TRANSFER_BACKEND, GlooWeightTransferEngine)
    except ValueError:  # registered already (the plugin ran twice in this process)
        pass
