"""What the per-tensor weight digests cost a push; prints JSON.

For each model (`tiny`, and SmolLM2-135M from its package), in float32 as the policy server serves
it by default: the seconds to hash every tensor once (XXH3-128, the TensorSpec.digest that the
learner computes before a push and the server again on what it received; SHA-256 and BLAKE2b,
the cryptographic candidates, for comparison), then whole gRPC pushes to a real policy server
process, alternating without digests (before) and with them (after: the learner's hashing, the
server's check before the swap, and the Describe that compares).

Output: {"cpu": ..., "models": {name: {"parameters": n, "bytes": n, "xxh3_128_s": median,
         "sha256_s": median, "blake2b_s": median, "xxh3_128_gb_per_s": ...,
         "push_without_digests_s": median, "push_with_digests_s": median,
         "ratio_with_over_without": median of per-round ratios}}}
Usage: python bench/weight_digests.py [--models tiny smollm2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import platform
import statistics
import time

import torch

from learner.push_types import check_serving
from sciproto.client.policy import PolicyClient, distinct_tensors
from sciproto.models import load_model
from sciproto.processes import start_server
from sciproto.weights.wire import _byte_view, tensor_digests


def timed(function, *args) -> float:
    start = time.perf_counter()
    function(*args)
    return time.perf_counter() - start


def blake2b_all(tensors) -> list[bytes]:
    return [hashlib.blake2b(_byte_view(t), digest_size=32).digest() for t in tensors.values()]


def sha256_all(tensors) -> list[bytes]:
    return [hashlib.sha256(_byte_view(t)).digest() for t in tensors.values()]


async def pushes(target: str, tensors, repeats: int) -> tuple[list[float], list[float]]:
    without, with_digests = [], []
    async with PolicyClient(target) as client:
        version = (await client.describe()).policy_version
        for _ in range(repeats):
            version += 1
            start = time.perf_counter()
            await client.push_weights(tensors, version)
            without.append(time.perf_counter() - start)
            version += 1
            start = time.perf_counter()
            digests = await asyncio.to_thread(tensor_digests, tensors)
            await client.push_weights(tensors, version, digests=digests)
            check_serving(target, await client.describe(), list(tensors), digests)
            with_digests.append(time.perf_counter() - start)
    return without, with_digests


def measure(model: str, repeats: int) -> dict[str, object]:
    loaded = load_model(model, dtype=torch.float32, seed=0)
    tensors = distinct_tensors(dict(loaded.model.state_dict()))
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    xxh = statistics.median(timed(tensor_digests, tensors) for _ in range(repeats))
    sha = statistics.median(timed(sha256_all, tensors) for _ in range(repeats))
    blake = statistics.median(timed(blake2b_all, tensors) for _ in range(repeats))
    server = start_server(["serve", "policy", "--port", "0", "--model", model], timeout_s=600)
    try:
        without, with_digests = asyncio.run(pushes(server.target, tensors, repeats))
    finally:
        server.stop()
    return {"parameters": sum(t.numel() for t in tensors.values()), "bytes": size, "xxh3_128_s": xxh,
            "sha256_s": sha, "blake2b_s": blake, "xxh3_128_gb_per_s": size / xxh / 1e9,
            "push_without_digests_s": statistics.median(without), "push_with_digests_s": statistics.median(with_digests),
            "ratio_with_over_without": statistics.median(b / a for a, b in zip(without, with_digests)),
            "runs": {"without": without, "with": with_digests}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps({"cpu": platform.processor() or platform.machine(),
                      "models": {model: measure(model, args.repeats) for model in args.models}}, indent=2))


if __name__ == "__main__":
    main()
