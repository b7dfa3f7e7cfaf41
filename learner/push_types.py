"""What every weight pusher shares: the result of one push and the interface the learner calls.

Its own module so that the pushers (`learner.weight_push`, `learner.collective_push`,
`learner.vllm_sync`) import it, and `learner.weight_push`, which chooses among them, imports
them without any of them importing it back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple, Protocol

import torch
from pydantic import BaseModel

from sciproto.errors import FailedPrecondition, Reason
from sciproto.pb import policy_pb2
from sciproto.weights.wire import set_digest


class PushResult(BaseModel):
    """One push to every policy server."""

    policy_version: int
    seconds: float
    servers: int
    # WeightsProvenance.set_digest of the weights pushed (empty: not computed)
    set_digest: bytes = b""
    # seconds spent hashing them (TensorSpec.digest of each tensor)
    hash_seconds: float = 0.0


class Serving(NamedTuple):
    """What a policy server reports serving (Describe)."""

    policy_version: int
    weights_digest: bytes  # empty: the server checked no digests of these weights


class ServingDigestMismatch(FailedPrecondition):
    """A policy server reports serving other weights than the ones pushed to it."""


def adapter_serving(described: policy_pb2.PolicyServiceDescribeResponse,
                    adapter: str) -> policy_pb2.AdapterServing | None:
    """Describe's entry of the LoRA adapter named `adapter`; None when the server holds none."""
    return next((entry for entry in described.adapters if entry.adapter.name == adapter), None)


def serving_of(described: policy_pb2.PolicyServiceDescribeResponse, adapter: str = "") -> Serving:
    """What a server serves of the base weights, or (`adapter`) of that LoRA adapter: version -1
    and no digest while it holds none, so that the learner pushes it."""
    if not adapter:
        return Serving(described.policy_version, described.weights_digest)
    entry = adapter_serving(described, adapter)
    return Serving(-1, b"") if entry is None else Serving(entry.policy_version, entry.weights_digest)


def check_serving(target: str, described: policy_pb2.PolicyServiceDescribeResponse,
                  names: Sequence[str], digests: Sequence[bytes], adapter: str = "") -> None:
    """After a push of the tensors `names` with `digests` (TensorSpec.digest), the server's
    Describe must report the same set digest; ServingDigestMismatch names the first tensor it
    holds otherwise. A server that reports no digest checked none (an NCCL update on a GPU, or a
    server older than these digests): nothing to compare. With `adapter`, the digest compared is
    that LoRA adapter's (Describe's `adapters`), which lists no tensor digests."""
    if adapter:
        _check_adapter(target, described, adapter, digests)
        return
    if not described.weights_digest or not digests:
        return
    if described.weights_digest == set_digest(digests):
        return
    serving = {spec.name: spec.digest for spec in described.serving_tensors}
    tensor = next((name for name, digest in zip(names, digests) if serving.get(name) != digest),
                  next(iter(serving.keys() - set(names)), ""))
    raise ServingDigestMismatch(
        f"policy server {target} serves version {described.policy_version} whose tensor {tensor!r} has digest "
        f"{serving.get(tensor, b'').hex() or 'none'}, not the {dict(zip(names, digests)).get(tensor, b'').hex() or 'none'} "
        "pushed; it does not serve the weights the learner trained (they are pushed again)",
        Reason.INVALID_WEIGHTS, metadata={"tensor": tensor, "target": target, "pushed_digest": set_digest(digests).hex()})


def _check_adapter(target: str, described: policy_pb2.PolicyServiceDescribeResponse, adapter: str,
                   digests: Sequence[bytes]) -> None:
    pushed = set_digest(digests) if digests else b""
    entry = adapter_serving(described, adapter)
    if entry is None:
        raise ServingDigestMismatch(
            f"policy server {target} lists no LoRA adapter {adapter!r} after its push; it does not serve the "
            "adapter the learner trained (it is pushed again)",
            Reason.INVALID_WEIGHTS, metadata={"tensor": "", "target": target, "pushed_digest": pushed.hex()})
    if not entry.weights_digest or not pushed or entry.weights_digest == pushed:
        return
    raise ServingDigestMismatch(
        f"policy server {target} serves LoRA adapter {adapter!r} version {entry.policy_version} with weights digest "
        f"{entry.weights_digest.hex()}, not the {pushed.hex()} pushed; it does not serve the adapter the learner "
        "trained (it is pushed again)",
        Reason.INVALID_WEIGHTS, metadata={"tensor": "", "target": target, "pushed_digest": pushed.hex()})


class WeightPusher(Protocol):
    """Sends new weights to every configured policy server."""

    async def serving_versions(self) -> list[int]:
        """The policy version each server serves now (Describe), in target order."""
        ...

    async def push(self, state_dict: Mapping[str, torch.Tensor], version: int) -> PushResult:
        """Make every server serve `state_dict` as `version` (greater than what they serve);
        raises the first failure once every push has ended."""
        ...

    async def aclose(self) -> None: ...


class ReconcilingPusher(WeightPusher, Protocol):
    """A pusher that can also reach servers one by one, so the learner can bring a server that
    fell behind (restarted, or missed a push) up to date without touching the others."""

    async def versions_each(self, timeout_s: float) -> list[int | None]:
        """Each target's serving version, None where it cannot be reached now."""
        ...

    async def push_to(
        self, indices: Sequence[int], state_dict: Mapping[str, torch.Tensor], version: int
    ) -> PushResult:
        """Push to the targets at `indices` only."""
        ...

    async def serving_each(self, timeout_s: float) -> list[Serving | None]:
        """Each target's serving version and weights digest, None where it cannot be reached now."""
        ...


__all__ = ["PushResult", "ReconcilingPusher", "Serving", "ServingDigestMismatch", "WeightPusher", "adapter_serving",
           "check_serving", "serving_of"]
