"""Policy server benchmark: Generate over gRPC against in-process batched `model.generate`, and
UpdateWeights against a raw loopback TCP copy of the same bytes. Prints one JSON object.

    python bench/policy.py [--tokens 128] [--weights-mb 100]

Generation uses greedy decoding on prompts whose greedy continuation runs at least `--tokens`
tokens without an end-of-turn token, so both sides produce exactly the same tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from clients.policy_client import PolicyClient, distinct_tensors, generate_request
from policy_server.models import load_model
from policy_server.models.byte_tokenizer import build_byte_tokenizer
from sciproto.processes import start_server

SEED = 3
MB = 1e6


# -- generation -----------------------------------------------------------------------------------


def long_greedy_prompts(model: torch.nn.Module, stop_ids: frozenset[int], count: int, tokens: int) -> list[list[int]]:
    """`count` byte prompts whose greedy continuation has no stop token in its first `tokens`."""
    rng, found = random.Random(0), []
    for _ in range(50):
        candidates = torch.tensor([[rng.randrange(32, 127) for _ in range(16)] for _ in range(64)])
        out = model.generate(candidates, attention_mask=torch.ones_like(candidates), do_sample=False,
                             max_new_tokens=tokens, pad_token_id=0)
        for prompt, row in zip(candidates.tolist(), out[:, 16:].tolist()):
            if not stop_ids & set(row):
                found.append(prompt)
        if len(found) >= count:
            return found[:count]
    raise RuntimeError(f"found only {len(found)} prompts that run {tokens} greedy tokens")


def direct_tokens_per_s(model: torch.nn.Module, prompts: list[list[int]], tokens: int, repeats: int) -> float:
    """The floor: one batched `model.generate` call over all prompts."""
    batch = torch.tensor(prompts)
    times = []
    for _ in range(repeats + 1):  # the first run warms up
        start = time.perf_counter()
        out = model.generate(batch, attention_mask=torch.ones_like(batch), do_sample=False,
                             max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=0)
        times.append(time.perf_counter() - start)
        assert out.shape[1] == batch.shape[1] + tokens
    return len(prompts) * tokens / statistics.median(times[1:])


async def grpc_tokens_per_s(target: str, prompts: list[list[int]], tokens: int, repeats: int) -> float:
    """Concurrent Generate calls, one per prompt, each a single greedy sample."""
    async with PolicyClient(target) as client:
        async def one(prompt: list[int]) -> int:
            request = generate_request(prompt_token_ids=prompt, temperature=0, max_tokens=tokens)
            group = await client.generate_group(request, timeout_s=600)
            return len(group.samples[0].completion_token_ids)

        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            counts = await asyncio.gather(*(one(p) for p in prompts))
            times.append(time.perf_counter() - start)
            assert counts == [tokens] * len(prompts), counts
        return len(prompts) * tokens / statistics.median(times[1:])


# -- weights --------------------------------------------------------------------------------------


def save_large_model(directory: Path, megabytes: float) -> int:
    """A random Qwen2 model of at least `megabytes` in fp32 over the byte tokenizer, saved as a
    local model directory; returns its parameter bytes."""
    tokenizer = build_byte_tokenizer()
    hidden, intermediate = 512, 1536
    per_layer = 4 * hidden * hidden + 3 * hidden * intermediate + 4 * hidden
    layers = max(1, -(-int(megabytes * MB / 4 - len(tokenizer) * hidden) // per_layer))
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
                         max_position_embeddings=2048, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(SEED)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return sum(p.numel() * p.element_size() for p in model.parameters())


async def grpc_push_mb_per_s(target: str, weights: Mapping[str, torch.Tensor], repeats: int) -> dict[str, float]:
    total = sum(t.numel() * t.element_size() for t in weights.values())
    async with PolicyClient(target) as client:
        version = (await client.describe()).policy_version
        times, apply = [], []
        for _ in range(repeats + 1):
            version += 1
            start = time.perf_counter()
            result = await client.push_weights(weights, version, timeout_s=600)
            times.append(time.perf_counter() - start)
            apply.append(result.apply_seconds)
            assert result.bytes_received == total
    return {"mb_per_s": total / MB / statistics.median(times[1:]), "apply_seconds": statistics.median(apply[1:])}


def _socket_receiver(port_queue: multiprocessing.Queue, total: int, repeats: int) -> None:
    """Child process: accept `repeats` connections, read `total` bytes of each into one
    preallocated buffer, answer one byte."""
    buffer = memoryview(bytearray(total))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port_queue.put(listener.getsockname()[1])
        for _ in range(repeats):
            connection, _ = listener.accept()
            with connection:
                received = 0
                while received < total:
                    count = connection.recv_into(buffer[received:], min(total - received, 4 << 20))
                    if count == 0:
                        raise ConnectionError("sender closed early")
                    received += count
                connection.sendall(b"k")


def socket_mb_per_s(weights: Mapping[str, torch.Tensor], repeats: int) -> float:
    """The baseline: the same tensors' bytes over one loopback TCP connection to a child process."""
    views = [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in weights.values()]
    total = sum(len(v) for v in views)
    ports: multiprocessing.Queue = multiprocessing.get_context("spawn").Queue()
    receiver = multiprocessing.get_context("spawn").Process(target=_socket_receiver, args=(ports, total, repeats + 1))
    receiver.start()
    port = ports.get(timeout=60)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        with socket.create_connection(("127.0.0.1", port), timeout=120) as connection:
            for view in views:
                connection.sendall(view)
            if connection.recv(1) != b"k":
                raise ConnectionError("receiver did not acknowledge")
        times.append(time.perf_counter() - start)
    receiver.join(timeout=60)
    return total / MB / statistics.median(times[1:])


# -- main -----------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128, help="New tokens per sample")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--weights-mb", type=float, default=100.0, help="Size of the model pushed by UpdateWeights")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    loaded = load_model("tiny", seed=SEED)
    prompts = long_greedy_prompts(loaded.model, loaded.stop_token_ids, max(args.concurrency), args.tokens)
    report: dict[str, object] = {"model": loaded.name, "tokens_per_sample": args.tokens, "torch_threads":
                                 torch.get_num_threads(), "generate": {}}
    server = start_server(["serve", "policy", "--port", "0", "--model", "tiny", "--set", f"seed={SEED}"])
    try:
        for concurrency in args.concurrency:
            batch = prompts[:concurrency]
            direct = direct_tokens_per_s(loaded.model, batch, args.tokens, args.repeats)
            served = asyncio.run(grpc_tokens_per_s(server.target, batch, args.tokens, args.repeats))
            report["generate"][f"concurrent_{concurrency}"] = {  # type: ignore[index]
                "direct_batched_tokens_per_s": round(direct, 1), "grpc_tokens_per_s": round(served, 1),
                "ratio_grpc_to_direct": round(served / direct, 3)}
    finally:
        server.stop()

    with tempfile.TemporaryDirectory() as directory:
        total = save_large_model(Path(directory), args.weights_mb)
        weights = distinct_tensors(load_model(directory).model.state_dict())
        weights = {name: torch.randn_like(t) * 0.02 for name, t in weights.items()}
        server = start_server(["serve", "policy", "--port", "0", "--model", directory])
        try:
            pushed = asyncio.run(grpc_push_mb_per_s(server.target, weights, args.repeats))
        finally:
            server.stop()
    raw = socket_mb_per_s(weights, args.repeats)
    report["update_weights"] = {"model_mb": round(total / MB, 1), "grpc_mb_per_s": round(pushed["mb_per_s"], 1),
                                "apply_seconds": round(pushed["apply_seconds"], 4),
                                "raw_socket_mb_per_s": round(raw, 1),
                                "ratio_grpc_to_socket": round(pushed["mb_per_s"] / raw, 3)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
