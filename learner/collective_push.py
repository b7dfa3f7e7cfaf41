"""Weight pushes whose tensors travel over a collective group (`push_transport: gloo | nccl`).

One push: every policy server gets an UpdateWeights call whose stream is only the header
(version, names, shapes, dtypes; transport COLLECTIVE), and while those calls run the learner, rank 0
of the group, broadcasts the tensors in header order; each server receives them
(`receive_weights_collective`) and answers its call once they are installed.

The orchestration is shared; a `Transfer` carries the tensors: `GlooTransfer` here
(torch.distributed gloo on the CPU, `sciproto.weights.group`, which transformers-backend
servers join), `learner.vllm_sync.VllmNcclTransfer` on GPUs with vLLM servers.

Failures: the push stops at the first failure of any server's call or of the broadcast, and
everything waits at most `timeout_s`. The error names each server's outcome, the learner logs it
and goes on (servers that missed a version are brought up to date by a later push), and the next
push forms a new group, since a group that lost a member cannot be trusted.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import grpc
import torch

from learner.push_types import PushResult, check_serving
from sciproto.channel import ServerAccess, make_channel
from sciproto.client.policy import distinct_tensors
from sciproto.errors import Reason, Unavailable, from_rpc_error
from sciproto.pb import policy_grpc, policy_pb2
from sciproto.weights.group import WeightGroup
from sciproto.weights.rendezvous import CollectiveRendezvous
from sciproto.weights.wire import header_for, set_digest, tensor_digests


class Transfer(Protocol):
    """The learner's end of a collective group."""

    def prepare(self) -> None:
        """Before the headers go out: name a new group if the last push failed (or none yet)."""
        ...

    def send(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """In a worker thread: join the group and broadcast `tensors` in order; every wait bounded."""
        ...

    def failed(self) -> None:
        """The push failed: the group must not be used again."""
        ...

    def close(self) -> None: ...


class GlooTransfer:
    """`sciproto.weights.group` on the learner's side (rank 0)."""

    def __init__(self, rendezvous: CollectiveRendezvous) -> None:
        self._group = WeightGroup(rendezvous, rank=0)
        self._name = ""

    def prepare(self) -> None:
        if not self._name:
            self._name = self._group.announce()

    def send(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._group.form(self._name)
        self._group.send(tensors)

    def failed(self) -> None:
        self._group.discard()
        self._name = ""

    def close(self) -> None:
        self._group.close()


class CollectiveWeightPusher:
    """A WeightPusher (see learner.weight_push) whose tensors travel over `transfer`."""

    def __init__(self, targets: Sequence[str], transfer: Transfer, timeout_s: float,
                 access: ServerAccess | None = None, answer_wait_s: float = 15.0, digests: bool = True) -> None:
        if not targets:
            raise ValueError("a collective weight push needs policy_targets: the servers that receive the weights")
        self.targets = list(targets)
        self.timeout_s = timeout_s
        self.answer_wait_s = min(answer_wait_s, timeout_s)  # after a failure, for the servers' own errors
        self._transfer = transfer
        self._digests = digests  # whether headers carry each tensor's digest (servers check them)
        access = access or ServerAccess()
        self._channels = [make_channel(access.channel(target)) for target in self.targets]
        self._stubs = [policy_grpc.PolicyServiceStub(channel) for channel in self._channels]
        self._sending: asyncio.Future | None = None  # the broadcast thread of the last push

    async def serving_versions(self) -> list[int]:
        described = await asyncio.gather(*(stub.Describe(policy_pb2.PolicyServiceDescribeRequest(),
                                                         timeout=self.timeout_s) for stub in self._stubs))
        return [d.policy_version for d in described]

    async def push(self, state_dict: Mapping[str, torch.Tensor], version: int) -> PushResult:
        started = time.monotonic()
        await self._settle_last_transfer()
        tensors = distinct_tensors(state_dict)  # tied weights once, as the servers' manifests list them
        # each tensor's digest in the header: a server checks what it received before it swaps
        digests = await asyncio.to_thread(tensor_digests, tensors) if self._digests else []
        hashed = time.monotonic() - started
        header = header_for(tensors, version, digests=digests or None)
        header.transport = policy_pb2.WEIGHT_TRANSPORT_COLLECTIVE
        self._transfer.prepare()
        calls = [asyncio.ensure_future(self._send_header(stub, header)) for stub in self._stubs]
        transfer = _in_daemon_thread(self._transfer.send, tensors)
        self._sending = transfer
        # A server that refuses the header never joins the broadcast, which would then wait for
        # it until the timeout: stop at the first failure, whichever side it comes from.
        done, _ = await asyncio.wait([transfer, *calls], timeout=self.timeout_s, return_when=asyncio.FIRST_EXCEPTION)
        failed = any(task.exception() is not None for task in done) or not transfer.done()
        if not failed:
            finished, _ = await asyncio.wait(calls, timeout=self.timeout_s)
            failed = len(finished) < len(calls) or any(call.exception() is not None for call in calls)
        if failed:
            self._transfer.failed()
            # each server answers once its own timeouts end; wait a little for what it says
            await asyncio.wait(calls, timeout=self.answer_wait_s)
            for call in calls:
                call.cancel()
            await asyncio.wait(calls, timeout=1.0)
            raise Unavailable(f"weight push of version {version} over the collective group failed: "
                              + "; ".join(self._outcomes(calls, transfer)), Reason.WEIGHTS_INCOMPLETE)
        described = await asyncio.gather(*(stub.Describe(policy_pb2.PolicyServiceDescribeRequest(),
                                                         timeout=self.timeout_s) for stub in self._stubs))
        for target, serving in zip(self.targets, described):
            check_serving(target, serving, list(tensors), digests)
        return PushResult(policy_version=version, seconds=time.monotonic() - started, servers=len(self.targets),
                          set_digest=set_digest(digests) if digests else b"", hash_seconds=hashed)

    def _outcomes(self, calls: list[asyncio.Future], transfer: asyncio.Future) -> list[str]:
        lines = []
        for target, call in zip(self.targets, calls):
            if call.cancelled() or not call.done():
                lines.append(f"{target}: no answer")
            elif call.exception() is not None:
                lines.append(f"{target}: {call.exception()}")
            else:
                lines.append(f"{target}: now serves version {call.result().policy_version}")
        if transfer.done() and not transfer.cancelled() and transfer.exception() is not None:
            lines.append(f"broadcast: {transfer.exception()}")
        elif not transfer.done():
            lines.append(f"broadcast: not finished after {self.timeout_s:.0f} s")
        return lines

    async def _settle_last_transfer(self) -> None:
        """A failed push's broadcast thread ends within its own timeouts; never overlap it."""
        if self._sending is not None and not self._sending.done():
            await asyncio.wait([self._sending], timeout=self.timeout_s)
        self._sending = None

    async def aclose(self) -> None:
        await self._settle_last_transfer()
        self._transfer.close()
        await asyncio.gather(*(channel.close() for channel in self._channels))

    async def _send_header(self, stub: policy_grpc.PolicyServiceStub,
                           header: policy_pb2.WeightsHeader) -> policy_pb2.UpdateWeightsResponse:
        try:
            return await stub.UpdateWeights(iter([policy_pb2.UpdateWeightsRequest(header=header)]),
                                            timeout=self.timeout_s)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from error


def _in_daemon_thread(function: Callable[..., object], *args: object) -> asyncio.Future:
    """Run `function` in a thread of its own whose result is an asyncio future. A daemon thread:
    a collective whose peer died may block past every timeout (NCCL has none), and it must not
    keep the learner's process alive after it exits."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(result: object, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            outcome: tuple[object, BaseException | None] = (function(*args), None)
        except BaseException as error:  # noqa: BLE001 -- handed to the awaiting push
            outcome = (None, error)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop closed while the collective was blocked: nobody waits
            pass

    threading.Thread(target=run, name="weight-broadcast", daemon=True).start()
    return future


def build_gloo_pusher(targets: Sequence[str], rendezvous: Mapping[str, object], timeout_s: float,
                      access: ServerAccess | None = None) -> CollectiveWeightPusher:
    """The pusher of `push_transport: gloo` (the learner's `collective:` section is the rendezvous)."""
    return CollectiveWeightPusher(targets, GlooTransfer(CollectiveRendezvous(**rendezvous)), timeout_s, access)
