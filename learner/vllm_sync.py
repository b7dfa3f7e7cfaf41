"""The learner's side of NCCL weight transfer to vLLM policy servers (`push_transport: nccl`).

One push: every policy server gets an UpdateWeights call whose stream is only the header
(version, names, shapes, dtypes; transport NCCL), and while those calls run the learner
broadcasts every tensor, in header order, from NCCL rank 0 to all vLLM workers of all servers
at once; each server's vLLM loads them (`VllmBackend.receive_weights_nccl`) and answers the call.

The NCCL group is vLLM's stateless process group (a TCP store hosted here as rank 0, then a
PyNccl communicator), opened by the first push while the servers join it on their first NCCL
header, as vLLM's RLHF weight-transfer examples do. Its rendezvous settings are the
`NcclRendezvous` model the servers read too (the learner's `nccl:` config section; rank_offset
only matters to servers).

vLLM is imported only when a pusher is built.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import torch

from clients.policy_client import PolicyClient, distinct_tensors
from learner.server_config import LearnerServerConfig
from learner.weight_push import PushResult
from policy_server.backends.vllm_backend import NcclRendezvous, import_vllm
from policy_server.weights_stream import header_for
from sciproto.channel import make_channel
from sciproto.errors import from_rpc_error
from sciproto.pb import policy_grpc, policy_pb2


class NcclWeightPusher:
    """A WeightPusher (see learner.weight_push) whose tensors travel over NCCL."""

    def __init__(self, targets: Sequence[str], rendezvous: NcclRendezvous, device: str, timeout_s: float) -> None:
        if not targets:
            raise ValueError("push_transport nccl needs policy_targets: the servers that receive the weights")
        if not device.startswith("cuda"):
            raise ValueError(f"NCCL weight transfer runs from a CUDA device; the learner's device is {device!r}")
        self.targets = list(targets)
        self.timeout_s = timeout_s
        self._rendezvous = rendezvous
        self._device = torch.device(device)
        self._channels = [make_channel(target) for target in self.targets]
        self._clients = [PolicyClient(channel) for channel in self._channels]
        self._stubs = [policy_grpc.PolicyServiceStub(channel) for channel in self._channels]
        self._group: Any = None  # vLLM's PyNcclCommunicator, once the first push opened it
        self._broken: str = ""  # why the group can no longer be used, after a failed push

    async def serving_versions(self) -> list[int]:
        described = await asyncio.gather(*(c.describe(timeout_s=self.timeout_s) for c in self._clients))
        return [d.policy_version for d in described]

    async def push(self, state_dict: Mapping[str, torch.Tensor], version: int) -> PushResult:
        if self._broken:
            raise RuntimeError(f"the NCCL weight-transfer group broke in an earlier push ({self._broken}); "
                               "restart the learner and the policy servers")
        started = time.monotonic()
        tensors = distinct_tensors(state_dict)  # tied weights once, as the servers' manifests list them
        header = header_for(tensors, version)
        header.transport = policy_pb2.WEIGHT_TRANSPORT_NCCL
        calls = [asyncio.ensure_future(self._send_header(stub, header)) for stub in self._stubs]
        transfer = asyncio.ensure_future(asyncio.to_thread(self._open_and_broadcast, tensors))
        # A server that refuses the header never joins the broadcast, which would then wait for
        # it forever: stop at the first failure, whichever side it comes from.
        done, _ = await asyncio.wait([transfer, *calls], timeout=self.timeout_s,
                                     return_when=asyncio.FIRST_EXCEPTION)
        failed = next((task for task in done if task.exception() is not None), None)
        if failed is not None or not transfer.done():
            self._broken = repr(failed.exception()) if failed is not None else "timed out"
            for call in calls:
                call.cancel()
            if failed is not None:
                raise failed.exception()  # type: ignore[misc]
            raise TimeoutError(f"NCCL weight push of version {version} did not finish in {self.timeout_s:.0f} s")
        await asyncio.wait_for(asyncio.gather(*calls), self.timeout_s)
        return PushResult(policy_version=version, seconds=time.monotonic() - started, servers=len(self.targets))

    async def aclose(self) -> None:
        if self._group is not None and not self._broken:
            self._group.destroy()
        await asyncio.gather(*(channel.close() for channel in self._channels))

    async def _send_header(self, stub: policy_grpc.PolicyServiceStub,
                           header: policy_pb2.WeightsHeader) -> policy_pb2.UpdateWeightsResponse:
        try:
            return await stub.UpdateWeights(iter([policy_pb2.UpdateWeightsRequest(header=header)]),
                                            timeout=self.timeout_s)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from error

    def _open_and_broadcast(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Runs in a worker thread: NCCL calls block until every peer takes part."""
        torch.cuda.set_device(self._device)
        if self._group is None:
            nccl_common = import_vllm("vllm.distributed.weight_transfer.nccl_common")
            self._group = nccl_common.trainer_init(self._rendezvous.model_dump(), rank=0)
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


def build_weight_pusher(config: LearnerServerConfig) -> NcclWeightPusher:
    """The hook `learner.weight_push.build_weight_pusher` calls for `push_transport: nccl`."""
    import_vllm()  # say which extra is missing before anything connects
    return NcclWeightPusher(config.policy_targets, NcclRendezvous(**config.nccl), config.device,
                            config.push_timeout_s)
