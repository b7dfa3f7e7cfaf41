"""Rollout collection throughput, and what client tracing costs; prints JSON.

Starts an env server (gsm8k) and a policy server (the `tiny` model) as child processes, then
collects `--episodes` GSM8K episodes with as many in flight at once (one sample per task, short
turns: the tiny random model never finishes a problem, so every episode runs `--max-steps`
turns). Each configuration is timed `--repeats` times, alternating, after one warm-up run:
  - tracing off: no exporter, no interceptors, no-op spans;
  - tracing on: the client's spans and gRPC client spans exported to a JSONL file.
Output: {"off": {"rollouts_per_s": median, "runs": [...]}, "on": {...},
         "throughput_ratio_on_over_off": ..., "spans_written": ..., ...}.
Usage: python bench/collect.py [--episodes 64] [--repeats 2] [--max-tokens 16] [--max-steps 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from clients.collect import CollectConfig, run_collection
from sciproto.config import load_config
from sciproto.processes import start_server
from sciproto.tracing import setup_tracing, shutdown_tracing


def timed_run(env: str, policy: str, config: CollectConfig, episodes: int, output: Path) -> dict[str, float]:
    setup_tracing(config.tracing, "sciproto-rollout")
    try:
        started = time.perf_counter()
        summary = asyncio.run(run_collection([env], [policy], "gsm8k:test", output, episodes, 1, episodes, config))
        seconds = time.perf_counter() - started
    finally:
        shutdown_tracing()
    if summary.infra_errors:
        raise RuntimeError(f"{summary.infra_errors} episodes failed; see {output}")
    return {"seconds": round(seconds, 3), "rollouts_per_s": round(episodes / seconds, 3),
            "completion_tokens": summary.tokens["completion"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-steps", type=int, default=2)
    args = parser.parse_args()

    env = start_server(["serve", "env", "--env", "gsm8k", "--port", "0"])
    policy = start_server(["serve", "policy", "--model", "tiny", "--port", "0"])
    try:
        with tempfile.TemporaryDirectory() as scratch:
            folder = Path(scratch)
            base = [f"sampling.max_tokens={args.max_tokens}", f"max_steps={args.max_steps}", "progress=false"]
            spans = folder / "spans.jsonl"
            configs = {
                "off": load_config(CollectConfig, None, base),
                "on": load_config(CollectConfig, None, [*base, "tracing.exporter=jsonl", f"tracing.jsonl_path={spans}"]),
            }
            # Each run writes a fresh file, so none resumes from another.
            timed_run(env.target, policy.target, configs["off"], args.episodes, folder / "warmup.jsonl")
            runs: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
            for repeat in range(args.repeats):
                for name, config in configs.items():
                    output = folder / f"{name}-{repeat}.jsonl"
                    runs[name].append(timed_run(env.target, policy.target, config, args.episodes, output))
            spans_written = sum(1 for _ in spans.open()) if spans.exists() else 0
    finally:
        env.stop()
        policy.stop()

    median = {name: round(statistics.median(r["rollouts_per_s"] for r in results), 3) for name, results in runs.items()}
    report = {
        "benchmark": "collect gsm8k, tiny policy",
        "episodes_in_flight": args.episodes,
        "max_tokens_per_turn": args.max_tokens,
        "max_steps": args.max_steps,
        "off": {"rollouts_per_s": median["off"], "runs": runs["off"]},
        "on": {"rollouts_per_s": median["on"], "runs": runs["on"]},
        "throughput_ratio_on_over_off": round(median["on"] / median["off"], 3),
        "spans_written": spans_written,
        "note": "tracing on = client spans and gRPC client spans to JSONL; servers untraced",
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    sys.exit(main())
