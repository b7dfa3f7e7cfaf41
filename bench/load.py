"""Load on one env server: many concurrent episodes, each looping reset -> step -> close, for a
fixed time. Reports steps/s, p50/p99 latency of each call, errors by status (goal: none), and the
server's resident memory before, at its peak during, and after the load (goal: back within 10%
of the start once every episode is closed).

The toy environment is used (one step per episode, no kernel or data files), so the figures are
the server's: registry, idempotency cache, gRPC, Aviary's message types. The server is started
here as a child process with `max_live_episodes` above the load, unless `--target` names one.
Progress goes to stderr; the JSON report to stdout (and `--output`).

    python bench/load.py [--episodes 1000] [--duration 60] [--rounds 3] [--output load.json]

With `--rounds N` the load runs N times on the same server; round 1's figures are the report's,
and `later_rounds` holds the others: the first load leaves what a fresh server allocates once
(about 15 MiB here), a leak would grow again in every round.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before anything imports aviary
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil

from sciproto.channel import ChannelConfig
from sciproto.client.env import EnvClient, new_request_id
from sciproto.errors import SciprotoError
from sciproto.pb import common_pb2
from sciproto.processes import ServerProcess, start_server

ENV = "toy"
SPLIT, SPLIT_SIZE = "train", 512
REPLY = common_pb2.ChatMessage(role=common_pb2.ROLE_ASSISTANT, content="42")
CHANNELS = 8  # episodes are spread over several HTTP/2 connections, as several clients would
CALL_TIMEOUT_S = 60.0
RETRY_WINDOW_S = 10.0  # the server's idle TTL, and so how long it keeps answers for retries
SETTLE_TIMEOUT_S = 30.0  # how long "after" waits for live episodes to reach 0 and memory to settle
MEMORY_GOAL = 1.10  # after / before


def progress(message: str) -> None:
    print(f"[load] {message}", file=sys.stderr, flush=True)


@dataclass
class Recorder:
    latencies_s: dict[str, list[float]] = field(default_factory=lambda: {"reset": [], "step": [], "close": []})
    errors: Counter[str] = field(default_factory=Counter)
    episodes: int = 0

    async def timed(self, operation: str, call: Any) -> Any:
        start = time.perf_counter()
        try:
            return await call
        except SciprotoError as error:
            self.errors[f"{operation}: {error.code.name} {error.reason}"] += 1
            return None
        finally:
            self.latencies_s[operation].append(time.perf_counter() - start)


async def episode_loop(client: EnvClient, worker: int, stop: asyncio.Event, record: Recorder) -> None:
    """reset -> step -> close until `stop`; an episode whose reset failed is not stepped."""
    index = worker
    while not stop.is_set():
        reset = await record.timed("reset", client.reset(ENV, split=SPLIT, index=index % SPLIT_SIZE,
                                                          timeout=CALL_TIMEOUT_S))
        index += 1
        if reset is None:
            await asyncio.sleep(0.1)  # the error is counted; do not spin on it
            continue
        await record.timed("step", client.step(reset.episode_id, REPLY, request_id=new_request_id(),
                                               timeout=CALL_TIMEOUT_S))
        await record.timed("close", client.close(reset.episode_id, timeout=CALL_TIMEOUT_S))
        record.episodes += 1


def percentiles_ms(latencies_s: list[float]) -> dict[str, float]:
    if not latencies_s:
        return {"p50": 0.0, "p99": 0.0, "count": 0}
    ordered = sorted(latencies_s)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {"p50": round(statistics.median(ordered) * 1e3, 2), "p99": round(p99 * 1e3, 2), "count": len(ordered)}


def rss_mib(process: psutil.Process) -> float:
    return process.memory_info().rss / 2**20


async def live_episodes(client: EnvClient) -> int:
    return (await client.describe(timeout=CALL_TIMEOUT_S)).counters.live_episodes


async def run(target: str, pid: int, episodes: int, duration_s: float) -> dict[str, Any]:
    server = psutil.Process(pid)
    clients = [EnvClient(ChannelConfig(target=target, default_timeout_s=CALL_TIMEOUT_S)) for _ in range(CHANNELS)]
    record = Recorder()
    try:
        # Warm up before the "before" figure: the first Reset builds the dataset and imports
        # settle, and every client opens its connection and its Session stream, which stay open
        # through "after" (they are closed at the end), so both figures hold the same connections.
        for client in clients:
            warm = await client.reset(ENV, split=SPLIT, index=0)
            await client.close(warm.episode_id)
        before = rss_mib(server)
        progress(f"server pid {pid}: {before:.1f} MiB before; {episodes} episodes for {duration_s:g} s")

        stop = asyncio.Event()
        workers = [asyncio.create_task(episode_loop(clients[i % CHANNELS], i, stop, record)) for i in range(episodes)]
        started, peak, peak_live = time.monotonic(), before, 0
        next_report = started + 5
        while (now := time.monotonic()) - started < duration_s:
            await asyncio.sleep(0.5)
            peak = max(peak, rss_mib(server))
            if now >= next_report:
                live = await live_episodes(clients[0])
                peak_live = max(peak_live, live)
                steps = len(record.latencies_s["step"])
                progress(f"{now - started:5.0f} s: {steps} steps ({steps / (now - started):.0f}/s), {live} live,"
                         f" {rss_mib(server):.1f} MiB, {sum(record.errors.values())} errors")
                next_report += 5
        stop.set()
        await asyncio.gather(*workers)
        elapsed = time.monotonic() - started

        settle_deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while (live := await live_episodes(clients[0])) and time.monotonic() < settle_deadline:
            await asyncio.sleep(0.2)
        after = rss_mib(server)
        while after > before * MEMORY_GOAL and time.monotonic() < settle_deadline:
            await asyncio.sleep(1.0)  # freed memory may return to the OS a little later
            after = rss_mib(server)
    finally:
        for client in clients:
            await client.aclose()

    steps = len(record.latencies_s["step"])
    return {
        "env": ENV, "episodes": episodes, "duration_s": round(elapsed, 1), "channels": CHANNELS,
        "steps": steps, "steps_per_s": round(steps / elapsed, 1), "episodes_completed": record.episodes,
        "latency_ms": {op: percentiles_ms(values) for op, values in record.latencies_s.items()},
        "errors": dict(record.errors), "errors_total": sum(record.errors.values()),
        "live_episodes_peak": peak_live, "live_episodes_after": live,
        "server_rss_mib": {"before": round(before, 1), "peak": round(peak, 1), "after": round(after, 1),
                           "after_over_before": round(after / before, 3)},
        "goals": {"no_errors": not record.errors, "memory_back_within_10pct": after <= before * MEMORY_GOAL},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=1000, help="concurrent episode loops")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    parser.add_argument("--target", help="HOST:PORT of a running env server hosting toy (needs --pid)")
    parser.add_argument("--pid", type=int, help="process id of the server at --target, for its memory")
    parser.add_argument("--set", dest="settings", action="append", default=[],
                        help="setting of the started server, KEY=VALUE (repeatable), e.g. idempotency_cache_size=64")
    parser.add_argument("--rounds", type=int, default=1,
                        help="loads in a row on the same server: the first pays one-time warm-up memory, the"
                             " later ones show whether memory keeps growing")
    parser.add_argument("--output", type=Path, help="also write the JSON report here")
    args = parser.parse_args()
    if (args.target is None) != (args.pid is None):
        parser.error("--target and --pid go together")

    server: ServerProcess | None = None
    if args.target is None:
        # Answers kept for retries expire with the episode idle TTL; a short TTL lets "after"
        # show the server once that window has passed, not the retry cache's last answers.
        settings = [f"max_live_episodes={args.episodes + 64}", f"idle_ttl_s={RETRY_WINDOW_S}", *args.settings]
        server = start_server(["serve", "env", "--env", ENV, "--port", "0",
                               *(arg for setting in settings for arg in ("--set", setting))], timeout_s=120)
        progress(f"started an env server at {server.target}")
    try:
        gc.collect()
        rounds = []
        for number in range(args.rounds):
            if args.rounds > 1:
                progress(f"round {number + 1} of {args.rounds}")
            rounds.append(asyncio.run(run(args.target or server.target, args.pid or server.process.pid,
                                          args.episodes, args.duration)))
        report = rounds[0]
        if len(rounds) > 1:
            # Round 1 includes what a fresh server allocates once (pools, caches) and keeps; a leak
            # would grow again in every later round.
            report["later_rounds"] = [{"steps_per_s": r["steps_per_s"], "errors_total": r["errors_total"],
                                       "server_rss_mib": r["server_rss_mib"]} for r in rounds[1:]]
            report["goals"]["later_rounds_no_errors"] = all(not r["errors"] for r in rounds[1:])
            report["goals"]["later_rounds_memory_back_within_10pct"] = all(
                r["goals"]["memory_back_within_10pct"] for r in rounds[1:])
    finally:
        if server is not None:
            server.stop()
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
