"""Pushing the learner's weights to the policy servers after optimizer steps.

Three transports share one interface, `WeightPusher` (`learner.push_types`):

- "grpc" (`GrpcWeightPusher`, any machine): every policy server receives the full weights as an
  UpdateWeights stream of raw chunks, all servers concurrently. A server swaps its weights in
  place once the whole stream arrived, so generation pauses only for the swap itself. With a
  LoRA adapter (`learner.lora`) it pushes the adapter's tensors alone under the header's
  `adapter`, and reads each server's version and digest of that adapter (Describe's `adapters`).
- "nccl" (GPU with vLLM): `learner.vllm_sync` provides `build_weight_pusher(config)` returning a
  `WeightPusher` whose tensors travel over NCCL while UpdateWeights carries only the header. It
  is imported only when chosen.
- "gloo" (any machine): the same header-only protocol with the tensors broadcast over a
  torch.distributed gloo group (`learner.collective_push`), which transformers-backend servers join.
"""

from __future__ import annotations

import asyncio
import importlib
import time
from collections.abc import Mapping, Sequence

import torch

from learner.push_types import (
    PushResult,
    ReconcilingPusher,
    Serving,
    WeightPusher,
    check_serving,
    serving_of,
)
from learner.server_config import LearnerServerConfig
from sciproto.channel import ServerAccess
from sciproto.client.policy import PolicyClient, distinct_tensors
from sciproto.config import ConfigError
from sciproto.errors import SciprotoError
from sciproto.lora import LoraSpec
from sciproto.pb import policy_pb2
from sciproto.weights.wire import set_digest, tensor_digests


class GrpcWeightPusher:
    """UpdateWeights chunk streams to every target, concurrently: the full weights, or with
    `adapter` that LoRA adapter's tensors, versioned as the adapter."""

    def __init__(self, targets: Sequence[str], timeout_s: float, access: ServerAccess | None = None,
                 adapter: LoraSpec | None = None) -> None:
        self.targets = list(targets)
        self.timeout_s = timeout_s
        self.adapter = adapter
        self._adapter_name = adapter.name if adapter is not None else ""
        self._access = access = access or ServerAccess()
        self._clients = [PolicyClient(access.channel(target)) for target in self.targets]
        self._retired: list[PolicyClient] = []  # clients of policy servers that moved (retarget)

    async def serving_versions(self) -> list[int]:
        """Each server's version (of the adapter: -1 where it holds none yet). With an adapter,
        ConfigError first names a server that takes no adapter of its rank."""
        described = await asyncio.gather(
            *(c.describe(timeout_s=self.timeout_s) for c in self._clients)
        )
        if self.adapter is not None:
            for target, served in zip(self.targets, described):
                _check_takes(target, served, self.adapter)
        return [serving_of(d, self._adapter_name).policy_version for d in described]

    async def push(self, state_dict: Mapping[str, torch.Tensor], version: int) -> PushResult:
        return await self.push_to(range(len(self._clients)), state_dict, version)

    async def versions_each(self, timeout_s: float) -> list[int | None]:
        return [None if serving is None else serving.policy_version for serving in await self.serving_each(timeout_s)]

    async def serving_each(self, timeout_s: float) -> list[Serving | None]:
        """Each target's serving version and weights digest, None where it cannot be reached now."""
        async def one(client: PolicyClient) -> Serving | None:
            try:
                described = await client.describe(timeout_s=timeout_s)
            except SciprotoError:
                return None
            return serving_of(described, self._adapter_name)

        return list(await asyncio.gather(*(one(c) for c in self._clients)))

    async def push_to(
        self, indices: Sequence[int], state_dict: Mapping[str, torch.Tensor], version: int
    ) -> PushResult:
        """Push with every tensor's digest in the header (each server checks what it received
        before it swaps), then ask each server what it serves: ServingDigestMismatch names a
        tensor that a server holds otherwise."""
        started = time.monotonic()
        clients = [self._clients[i] for i in indices]
        tensors = distinct_tensors(state_dict)
        digests = await asyncio.to_thread(tensor_digests, tensors)
        hashed = time.monotonic() - started
        adapter = self.adapter.to_proto() if self.adapter is not None else None
        pushes = await asyncio.gather(
            *(client.push_weights(tensors, version, timeout_s=self.timeout_s, digests=digests, adapter=adapter)
              for client in clients),
            return_exceptions=True)
        for outcome in pushes:  # the first failure, once every push has ended
            if isinstance(outcome, BaseException):
                raise outcome
        described = await asyncio.gather(*(client.describe(timeout_s=self.timeout_s) for client in clients))
        for index, serving in zip(indices, described):
            check_serving(self.targets[index], serving, list(tensors), digests, self._adapter_name)
        return PushResult(policy_version=version, seconds=time.monotonic() - started, servers=len(clients),
                          set_digest=set_digest(digests), hash_seconds=hashed)

    async def retarget(self, index: int, target: str) -> None:
        """Push to `target` from now on in place of policy server `index` (it moved). The old
        client is closed with the pusher, not now: closing its channel would cancel a call still
        on it (a reconcile's Describe), and the CancelledError would end that loop."""
        self._retired.append(self._clients[index])
        self._clients[index] = PolicyClient(self._access.channel(target))
        self.targets[index] = target

    async def aclose(self) -> None:
        await asyncio.gather(*(client.close() for client in [*self._clients, *self._retired]))


def _check_takes(target: str, described: policy_pb2.PolicyServiceDescribeResponse, adapter: LoraSpec) -> None:
    """ConfigError unless the server can load `adapter` (Describe's max_adapters, max_adapter_rank)."""
    if not described.max_adapters:
        raise ConfigError(f"policy server {target} ({described.backend}) takes no LoRA adapters (Describe: "
                          f"max_adapters 0), and learner.lora trains adapter {adapter.name!r}; serve the model "
                          "with a backend that takes adapters, or leave learner.lora unset")
    if described.max_adapter_rank and adapter.rank > described.max_adapter_rank:
        raise ConfigError(f"policy server {target} takes LoRA adapters up to rank {described.max_adapter_rank}, "
                          f"and learner.lora.rank is {adapter.rank}; lower the rank or raise the server's limit")


def build_weight_pusher(config: LearnerServerConfig) -> WeightPusher:
    """The pusher of `config.push_transport` for `config.policy_targets` (with `config.lora`,
    grpc only: the config refuses the others)."""
    if config.push_transport == "grpc":
        return GrpcWeightPusher(config.policy_targets, config.push_timeout_s, config.policy_access, config.lora)
    if config.push_transport == "gloo":
        from learner.collective_push import build_gloo_pusher

        return build_gloo_pusher(config.policy_targets, config.collective, config.push_timeout_s, config.policy_access)
    try:
        module = importlib.import_module("learner.vllm_sync")
    except ImportError as error:
        raise ConfigError(
            f"push_transport 'nccl' needs learner.vllm_sync and vLLM ({error}); install the "
            "sciproto[vllm] extra on a GPU machine or use push_transport=grpc"
        ) from error
    return module.build_weight_pusher(config)


def version_after_resume(own_version: int, serving: Sequence[int]) -> int:
    """The version to push after a restart so that every server accepts it.

    A server may already serve our version or a newer one (weights pushed after the checkpoint
    we resume from); versions must only grow, so we continue above the largest one seen.
    """
    highest = max(serving, default=-1)
    return own_version if own_version > highest else highest + 1


__all__ = [
    "GrpcWeightPusher",
    "PushResult",
    "ReconcilingPusher",
    "WeightPusher",
    "build_weight_pusher",
    "version_after_resume",
]
