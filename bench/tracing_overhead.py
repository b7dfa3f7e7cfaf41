"""What tracing costs a whole collection, with spans exported in all three processes; prints JSON.

Two pairs of servers run side by side, each an env server (toy) and a policy server (the `tiny`
model): one pair with tracing off, one with the JSONL exporter (each process its own file). The
same collection (`--episodes` toy episodes, all in flight at once) runs against each pair in
turn, off, on, off, on, ..., `--repeats` times each after one warm-up of each, so that drift in
the machine's load hits both alike. The client traces (JSONL) when it talks to the traced pair.

Two figures per run: throughput (episodes / wall second), and the CPU seconds the three processes
spent on it (client, env server and policy server, all threads: exporter threads included).
On a busy machine wall time swings with other work; CPU time much less so.

Output: {"off": {"rollouts_per_s": median, "cpu_s": median, "runs": [...]}, "on": {...},
         "median_ratio_on_over_off": median of the per-round throughput ratios (on / off),
         "median_cpu_ratio_on_over_off": median of the per-round CPU-seconds ratios (on / off),
         "spans_written": {"client": n, "env": n, "policy": n}, ...}
Usage: python bench/tracing_overhead.py [--episodes 32] [--repeats 5] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import psutil

from clients.collect import CollectConfig, run_collection
from sciproto.config import load_config
from sciproto.processes import ServerProcess, start_server
from sciproto.tracing import setup_tracing, shutdown_tracing


def traced(path: Path | None) -> list[str]:
    return [] if path is None else ["--set", "tracing.exporter=jsonl", "--set", f"tracing.jsonl_path={path}"]


def start_pair(folder: Path | None) -> tuple[ServerProcess, ServerProcess]:
    env = start_server(["serve", "env", "--env", "toy", "--port", "0",
                        *traced(folder / "env.jsonl" if folder else None)])
    policy = start_server(["serve", "policy", "--model", "tiny", "--port", "0",
                           *traced(folder / "policy.jsonl" if folder else None)])
    return env, policy


def timed_run(pair: tuple[ServerProcess, ServerProcess], config: CollectConfig, episodes: int,
              output: Path) -> dict[str, float]:
    env, policy = pair
    servers = [psutil.Process(server.process.pid) for server in pair]
    setup_tracing(config.tracing, "sciproto-rollout")
    try:
        cpu_before = cpu_seconds(servers)
        started = time.perf_counter()
        summary = asyncio.run(run_collection([env.target], [policy.target], "toy:test", output, episodes, 1,
                                             episodes, config))
        seconds = time.perf_counter() - started
    finally:
        shutdown_tracing()  # exports the client's last spans: part of the cost
    cpu = cpu_seconds(servers) - cpu_before
    if summary.infra_errors or summary.rollouts != episodes:
        raise RuntimeError(f"{summary.infra_errors} of {episodes} episodes failed; see {output}")
    return {"seconds": round(seconds, 3), "rollouts_per_s": round(episodes / seconds, 3), "cpu_s": round(cpu, 3)}


def cpu_seconds(servers: list[psutil.Process]) -> float:
    """User + system CPU seconds so far of this process and of `servers` (all threads)."""
    return time.process_time() + sum(sum(server.cpu_times()[:2]) for server in servers)


def count_lines(path: Path) -> int:
    return sum(1 for _ in path.open()) if path.exists() else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        spans = folder / "spans"
        spans.mkdir()
        pairs = {"off": start_pair(None), "on": start_pair(spans)}
        try:
            base = [f"sampling.max_tokens={args.max_tokens}", "max_steps=1", "progress=false"]
            configs = {"off": load_config(CollectConfig, None, base),
                       "on": load_config(CollectConfig, None, [*base, "tracing.exporter=jsonl",
                                                                f"tracing.jsonl_path={spans / 'client.jsonl'}"])}
            runs: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
            # Each run writes a fresh file, so none resumes from another.
            for name, config in configs.items():
                timed_run(pairs[name], config, args.episodes, folder / f"warmup-{name}.jsonl")
            for repeat in range(args.repeats):
                for name, config in configs.items():
                    output = folder / f"{name}-{repeat}.jsonl"
                    runs[name].append(timed_run(pairs[name], config, args.episodes, output))
        finally:
            for server in (*pairs["off"], *pairs["on"]):
                server.stop()  # the traced servers flush their spans on the way out
        written = {name: count_lines(spans / f"{name}.jsonl") for name in ("client", "env", "policy")}

    def median(name: str, figure: str) -> float:
        return round(statistics.median(run[figure] for run in runs[name]), 3)

    def median_ratio(figure: str) -> float:
        # Rounds ran off then on back to back: the ratio within a round cancels slow drift.
        return round(statistics.median(on[figure] / off[figure] for off, on in zip(runs["off"], runs["on"])), 3)

    report = {
        "benchmark": "tracing overhead: toy collection, tiny policy, JSONL spans in client, env and policy",
        "episodes_in_flight": args.episodes,
        "max_tokens_per_turn": args.max_tokens,
        "repeats": args.repeats,
        **{name: {"rollouts_per_s": median(name, "rollouts_per_s"), "cpu_s": median(name, "cpu_s"),
                  "runs": runs[name]} for name in ("off", "on")},
        "median_ratio_on_over_off": median_ratio("rollouts_per_s"),
        "median_cpu_ratio_on_over_off": median_ratio("cpu_s"),
        "spans_written": written,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
