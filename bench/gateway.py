"""Gateway benchmark: the same chat calls through `sciproto serve gateway` (HTTP, the `openai`
SDK's async client, each call in a session of its own) and straight to Generate (the gRPC client),
`--sessions` at once, interleaved for `--repeats` rounds after a warm-up. Prints one JSON object:
completion tokens/s and the median seconds per call of each way, per round and the medians, the
ratio gateway / direct of tokens/s (goal >= 0.9) and the median per-call overhead in ms.

Both ways send the same prompt, seed and max_tokens to the same policy server (`--model`, started
here with `--threads` OMP threads), so they sample the same tokens.

    python bench/gateway.py [--model tiny|smollm2] [--sessions 16] [--tokens 32] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import uuid

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import openai

from sciproto.client.policy import PolicyClient, generate_request
from sciproto.pb import common_pb2
from sciproto.processes import start_server

PROMPT = "Write a long story about a lighthouse keeper and a storm."


async def via_gateway(client: openai.AsyncOpenAI, model: str, seed: int, tokens: int) -> tuple[float, int]:
    start = time.perf_counter()
    reply = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], seed=seed, max_tokens=tokens,
        extra_headers={"X-Sciproto-Session": f"bench-{uuid.uuid4().hex}"})
    return time.perf_counter() - start, reply.usage.completion_tokens


async def via_generate(policy: PolicyClient, seed: int, tokens: int) -> tuple[float, int]:
    start = time.perf_counter()
    message = common_pb2.ChatMessage(role=common_pb2.ROLE_USER, content=PROMPT)
    group = await policy.generate_group(generate_request(messages=[message], seed=seed, max_tokens=tokens))
    return time.perf_counter() - start, sum(len(s.completion_token_ids) for s in group.samples)


async def round_of(calls: list) -> dict[str, float]:
    start = time.perf_counter()
    results = await asyncio.gather(*calls)
    wall = time.perf_counter() - start
    return {"tokens_per_s": sum(n for _, n in results) / wall,
            "p50_call_s": statistics.median(seconds for seconds, _ in results)}


async def bench(args: argparse.Namespace, policy_target: str, gateway_target: str) -> dict:
    client = openai.AsyncOpenAI(base_url=f"http://{gateway_target}/v1", api_key="unused", max_retries=0,
                                timeout=600)
    model = (await client.models.list()).data[0].id
    rounds: dict[str, list[dict[str, float]]] = {"gateway": [], "direct": []}
    async with PolicyClient(policy_target) as policy:
        for repeat in range(args.repeats + 1):
            seeds = range(repeat * args.sessions, (repeat + 1) * args.sessions)
            direct = await round_of([via_generate(policy, seed, args.tokens) for seed in seeds])
            through = await round_of([via_gateway(client, model, seed, args.tokens) for seed in seeds])
            if repeat:  # the first round warms both up
                rounds["direct"].append(direct)
                rounds["gateway"].append(through)
    medians = {way: {key: statistics.median(r[key] for r in results) for key in ("tokens_per_s", "p50_call_s")}
               for way, results in rounds.items()}
    return {"model": args.model, "sessions": args.sessions, "tokens": args.tokens, "repeats": args.repeats,
            "threads": args.threads, "rounds": rounds, "medians": medians,
            "tokens_per_s_ratio": medians["gateway"]["tokens_per_s"] / medians["direct"]["tokens_per_s"],
            "p50_overhead_ms": 1000 * (medians["gateway"]["p50_call_s"] - medians["direct"]["p50_call_s"])}


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
                                "--max-sessions", str(args.sessions * (args.repeats + 2))], timeout_s=120)
        try:
            print(json.dumps(asyncio.run(bench(args, policy.target, gateway.target)), indent=2))
        finally:
            gateway.stop()
    finally:
        policy.stop()


if __name__ == "__main__":
    main()
