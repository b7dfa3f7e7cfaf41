"""The learner's side of NCCL weight transfer to vLLM policy servers (`push_transport: nccl`).

The push protocol is `learner.collective_push` (header-only UpdateWeights calls to every server
while the learner broadcasts the tensors in header order, stopping at the first failure, every
wait bounded by `push_timeout_s`); this module supplies its NCCL transfer, whose peers are the
vLLM workers that join on their first collective header (`VllmBackend.receive_weights_collective`).

The NCCL group is vLLM's stateless process group (a TCP store hosted here as rank 0, then a
PyNccl communicator), opened by the first push while the servers join it, as vLLM's RLHF
weight-transfer examples do. Its rendezvous settings are the `NcclRendezvous` model the servers
read too (the learner's `collective:` section; rank_offset only matters to servers). NCCL collectives
have no timeout of their own: the push stops waiting after `push_timeout_s` and the broadcast
runs in a daemon thread. A group in which a push failed is never used again (vLLM cannot re-form
it under running workers), so later pushes fail at once, naming the first failure: restart the
learner and the policy servers.

vLLM is imported only when a pusher is built; every name of it used here is listed in
`policy_server.backends.vllm_api` and checked against the pinned release's source.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from learner.collective_push import CollectiveWeightPusher
from learner.server_config import LearnerServerConfig
from sciproto.channel import ServerAccess
from sciproto.errors import FailedPrecondition, Reason
from sciproto.weights.rendezvous import CollectiveRendezvous as NcclRendezvous
from sciproto.weights.vllm import import_vllm


class VllmNcclTransfer:
    """A `learner.collective_push.Transfer` over vLLM's NCCL weight-transfer group (rank 0)."""

    def __init__(self, rendezvous: NcclRendezvous, device: str) -> None:
        if not device.startswith("cuda"):
            raise ValueError(f"NCCL weight transfer runs from a CUDA device; the learner's device is {device!r}")
        self._rendezvous = rendezvous
        self._device = torch.device(device)
        self._group: Any = None  # vLLM's PyNcclCommunicator, once the first push opened it
        self._broken = ""  # why the group can no longer be used

    def prepare(self) -> None:
        if self._broken:
            raise FailedPrecondition(f"the NCCL weight-transfer group broke in an earlier push ({self._broken}); "
                                     "restart the learner and the policy servers", Reason.WEIGHTS_UNAVAILABLE)

    def send(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Runs in a worker thread: NCCL calls block until every peer takes part."""
        torch.cuda.set_device(self._device)
        if self._group is None:
            nccl_common = import_vllm("vllm.distributed.weight_transfer.nccl_common")
            store = self._rendezvous.model_dump(include={"master_address", "master_port", "world_size"})
            self._group = nccl_common.trainer_init(store, rank=0)
        # in header order, which is the order the servers' workers receive in
        on_device = ((name, tensor.detach().to(self._device)) for name, tensor in tensors.items())
        if self._rendezvous.packed:
            packed = import_vllm("vllm.distributed.weight_transfer.packed_tensor")
            packed.packed_nccl_broadcast_producer(
                iterator=on_device, group=self._group, src=0, post_iter_func=lambda item: item[1],
                buffer_size_bytes=packed.DEFAULT_PACKED_BUFFER_SIZE_BYTES,
                num_buffers=packed.DEFAULT_PACKED_NUM_BUFFERS)
        else:
            stream = torch.cuda.current_stream()
            for _name, tensor in on_device:
                self._group.broadcast(tensor.contiguous(), src=0, stream=stream)
        torch.cuda.current_stream().synchronize()

    def failed(self) -> None:
        self._broken = self._broken or "a push failed or timed out"

    def close(self) -> None:
        if self._group is not None and not self._broken:
            self._group.destroy()
        self._group = None


class NcclWeightPusher(CollectiveWeightPusher):
    """A WeightPusher (see learner.weight_push) whose tensors travel over vLLM's NCCL group."""

    def __init__(self, targets: Sequence[str], rendezvous: NcclRendezvous, device: str, timeout_s: float,
                 access: ServerAccess | None = None) -> None:
        if not targets:
            raise ValueError("push_transport nccl needs policy_targets: the servers that receive the weights")
        # No digests: vLLM's NCCL engine loads each tensor as it arrives, on the GPU, so a server
        # cannot check them before the swap, and hashing here would copy the model off the GPU
        # every push for nothing.
        super().__init__(targets, VllmNcclTransfer(rendezvous, device), timeout_s, access, digests=False)


def build_weight_pusher(config: LearnerServerConfig) -> NcclWeightPusher:
    """The hook `learner.weight_push.build_weight_pusher` calls for `push_transport: nccl`."""
    import_vllm()  # say which extra is missing before anything connects
    return NcclWeightPusher(config.policy_targets, NcclRendezvous(**config.collective), config.device,
                            config.push_timeout_s, config.policy_access)
