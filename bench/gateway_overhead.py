"""Gateway benchmark: the same chat calls through `sciproto serve gateway` (HTTP, each call in a
session of its own) and straight to Generate (the gRPC client), `--sessions` at once, interleaved
for `--repeats` rounds after a warm-up. Prints one JSON object: completion tokens/s and the median
seconds per call of each way, per round and the medians, the ratio of each gateway way to direct of
tokens/s (goal >= 0.9) and its median per-call overhead in ms, and the CPU each process spent per
call (client: this process; gateway; policy server), which says whose work a gap is.

The gateway is called three ways, each the best of its kind, so that the client's cost is told
apart from the gateway's: `sdk`, the `openai` SDK's async client as an agent gets it (its default
httpx transport); `sdk_aiohttp`, the same SDK on its aiohttp transport (`DefaultAioHttpClient`,
which the SDK offers for concurrency); `http`, a plain aiohttp client posting the same JSON (the
gateway's own cost, with next to no client work).

Both sides send the same prompt, seed and max_tokens to the same policy server (`--model`, started
here with `--threads` OMP threads), so they sample the same tokens.

    python bench/gateway_overhead.py [--model tiny|smollm2] [--sessions 16] [--tokens 32] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import aiohttp
import openai
import psutil

from sciproto.client.policy import PolicyClient, generate_request
from sciproto.pb import common_pb2
from sciproto.processes import start_server

PROMPT = "Write a long story about a lighthouse keeper and a storm."
# The SDK's aiohttp transport needs a recent `openai` (and httpx-aiohttp); without it that way is left out.
GATEWAY_WAYS = ("sdk", "sdk_aiohttp", "http") if hasattr(openai, "DefaultAioHttpClient") else ("sdk", "http")

Call = Callable[[int], Awaitable[tuple[float, int]]]


def session_header() -> dict[str, str]:
    return {"X-Sciproto-Session": f"bench-{uuid.uuid4().hex}"}


def via_sdk(client: openai.AsyncOpenAI, model: str, tokens: int) -> Call:
    async def call(seed: int) -> tuple[float, int]:
        start = time.perf_counter()
        reply = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPT}], seed=seed, max_tokens=tokens,
            extra_headers=session_header())
        return time.perf_counter() - start, reply.usage.completion_tokens
    return call


def via_http(http: aiohttp.ClientSession, url: str, model: str, tokens: int) -> Call:
    async def call(seed: int) -> tuple[float, int]:
        start = time.perf_counter()
        body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "seed": seed, "max_tokens": tokens}
        async with http.post(url, json=body, headers=session_header()) as response:
            response.raise_for_status()
            reply = await response.json()
        return time.perf_counter() - start, reply["usage"]["completion_tokens"]
    return call


def via_generate(policy: PolicyClient, tokens: int) -> Call:
    async def call(seed: int) -> tuple[float, int]:
        start = time.perf_counter()
        message = common_pb2.ChatMessage(role=common_pb2.ROLE_USER, content=PROMPT)
        group = await policy.generate_group(generate_request(messages=[message], seed=seed, max_tokens=tokens))
        return time.perf_counter() - start, sum(len(s.completion_token_ids) for s in group.samples)
    return call


class Cpu:
    """CPU seconds of this process and of the servers, all threads: from the scheduler's own
    count (/proc/PID/task/*/schedstat, nanoseconds) where there is one, since the tick-sampled
    user and system times miss the short bursts that one call is; else those."""

    def __init__(self, servers: dict[str, int]) -> None:
        self.processes = {"client": psutil.Process(), **{name: psutil.Process(pid) for name, pid in servers.items()}}

    @staticmethod
    def _seconds(process: psutil.Process) -> float:
        tasks = Path(f"/proc/{process.pid}/task")
        if not tasks.is_dir():
            return sum(process.cpu_times()[:2])
        total = 0
        for task in tasks.iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
                pass
        return total / 1e9

    def read(self) -> dict[str, float]:
        return {name: self._seconds(process) for name, process in self.processes.items()}


async def round_of(call: Call, seeds: range, cpu: Cpu) -> dict[str, float]:
    before = cpu.read()
    start = time.perf_counter()
    results = await asyncio.gather(*(call(seed) for seed in seeds))
    wall = time.perf_counter() - start
    after = cpu.read()
    return {"tokens_per_s": sum(n for _, n in results) / wall,
            "p50_call_s": statistics.median(seconds for seconds, _ in results),
            **{f"{name}_cpu_s": after[name] - before[name] for name in after}}


async def bench(args: argparse.Namespace, policy_target: str, gateway_target: str, cpu: Cpu) -> dict:
    base_url = f"http://{gateway_target}/v1"
    sdk = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    sdk_aiohttp = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600,
                                     http_client=openai.DefaultAioHttpClient(timeout=600)
                                     if "sdk_aiohttp" in GATEWAY_WAYS else None)
    model = (await sdk.models.list()).data[0].id
    ways = ("direct", *GATEWAY_WAYS)
    rounds: dict[str, list[dict[str, float]]] = {way: [] for way in ways}
    async with PolicyClient(policy_target) as policy, sdk, sdk_aiohttp, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        calls = {"direct": via_generate(policy, args.tokens), "sdk": via_sdk(sdk, model, args.tokens),
                 "sdk_aiohttp": via_sdk(sdk_aiohttp, model, args.tokens),
                 "http": via_http(http, f"{base_url}/chat/completions", model, args.tokens)}
        for repeat in range(args.repeats + 1):
            seeds = range(repeat * args.sessions, (repeat + 1) * args.sessions)
            for way in ways:
                result = await round_of(calls[way], seeds, cpu)
                if repeat:  # the first round warms every way up
                    rounds[way].append(result)
    calls_per_way = args.sessions * args.repeats
    medians = {way: {key: statistics.median(r[key] for r in results) for key in ("tokens_per_s", "p50_call_s")}
               for way, results in rounds.items()}
    cpu_ms = {way: {name: round(1000 * sum(r[f"{name}_cpu_s"] for r in results) / calls_per_way, 3)
                    for name in cpu.processes} for way, results in rounds.items()}
    direct = medians["direct"]
    return {"model": args.model, "sessions": args.sessions, "tokens": args.tokens, "repeats": args.repeats,
            "threads": args.threads, "rounds": rounds, "medians": medians, "cpu_ms_per_call": cpu_ms,
            "tokens_per_s_ratio": {way: medians[way]["tokens_per_s"] / direct["tokens_per_s"]
                                   for way in GATEWAY_WAYS},
            "p50_overhead_ms": {way: 1000 * (medians[way]["p50_call_s"] - direct["p50_call_s"])
                                for way in GATEWAY_WAYS}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    policy = start_server(["serve", "policy", "--port", "0", "--model", args.model], timeout_s=600)
    try:
        gateway = start_server(["serve", "gateway", "--port", "0", "--policy", policy.target,
                                "--max-sessions", str(args.sessions * len(GATEWAY_WAYS) * (args.repeats + 2))],
                               timeout_s=120)
        try:
            cpu = Cpu({"gateway": gateway.process.pid, "policy": policy.process.pid})
            print(json.dumps(asyncio.run(bench(args, policy.target, gateway.target, cpu)), indent=2))
        finally:
            gateway.stop()
    finally:
        policy.stop()


if __name__ == "__main__":
    main()
