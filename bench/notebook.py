"""What the pool of warm sandboxed kernels saves a notebook episode: Reset, first step and Fork
latency with the pool (warm) and without it (cold, every Reset and Fork boots a kernel), in one run.

Both modes use the same environment code (env_servers.envs.notebook) with the bwrap sandbox; only
`pool_size` differs: POOL_SIZE (warm: kernels started ahead, pandas and numpy imported ahead) or 0
(cold: the behaviour without a pool). Runs in this process, no gRPC: the figures are the
environment's own. Each round, at each concurrency (1 episode, then 8 at once), runs the two modes
one after the other, alternating which goes first:

  Reset         `concurrency` episodes reset at once; each Reset's own time
  first step    a cell that reads the task's first CSV file with pandas, in each of them at once
  Fork          two more cells (a parent of 3 cells), then each is forked at once; each Fork's time

Before each timed phase of the warm mode the pool is let fill up (the wait is not timed): the
figures are those of a pool that has had time to refill since the last burst, as between the
bursts of a rollout client; a phase that still found it short is counted in `misses`. Prints JSON
with p50/p95 per mode and the ratios warm/cold (goals: Reset <= 0.1, first step <= 0.5,
Fork <= 0.5).

    python bench/notebook.py [--rounds 3] [--concurrency 1 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before anything imports aviary
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aviary.core import ToolCall, ToolRequestMessage

from env_servers.catalog import load_source
from env_servers.envs.notebook import DataAnalysisEnv, NotebookSource

T = TypeVar("T")
POOL_SIZE = 8
FILL_TIMEOUT_S = 300.0
GOALS = {"reset_p50_warm_over_cold": 0.1, "first_step_p50_warm_over_cold": 0.5, "fork_p50_warm_over_cold": 0.5}


def progress(message: str) -> None:
    print(f"[notebook] {message}", file=sys.stderr, flush=True)


def cell(code: str) -> ToolRequestMessage:
    return ToolRequestMessage(tool_calls=[ToolCall.from_name("edit_cell", contents=code)])


async def timed(work: Awaitable[T]) -> tuple[float, T]:
    """Milliseconds `work` took, and its result."""
    started = time.perf_counter()
    result = await work
    return (time.perf_counter() - started) * 1e3, result


async def step_ok(env: DataAnalysisEnv, code: str) -> None:
    observations, _, _, _ = await env.step(cell(code))
    if "Error" in observations[0].content:
        raise RuntimeError(f"a cell failed: {observations[0].content[:500]}")


async def fill(source: NotebookSource) -> None:
    """Until the pool holds its size (nothing to wait for without a pool)."""
    deadline = time.monotonic() + FILL_TIMEOUT_S
    while (stats := source.pool_stats()).warm < stats.size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the pool did not fill within {FILL_TIMEOUT_S:g} s: {stats}")
        await asyncio.sleep(0.05)


async def one_phase_set(source: NotebookSource, concurrency: int, round_: int) -> dict[str, list[float]]:
    """Reset, first step and Fork of `concurrency` episodes at once: each operation's milliseconds."""
    tasks = [(round_ * concurrency + i) % source.splits["test"] for i in range(concurrency)]
    envs: list[DataAnalysisEnv] = [await source.make("test", index) for index in tasks]  # type: ignore[misc]
    forks: list[DataAnalysisEnv] = []
    try:
        await fill(source)
        resets = await asyncio.gather(*(timed(env.reset()) for env in envs))
        files = [json.loads(source.task_summary("test", index)["files"])[0] for index in tasks]
        steps = await asyncio.gather(*(timed(step_ok(env, f"import pandas as pd\ndf = pd.read_csv({name!r})\n"
                                                      "print(len(df))")) for env, name in zip(envs, files)))
        for env in envs:  # the parent's other two cells, untimed
            await step_ok(env, "numbers = df.select_dtypes('number')\ntotal = float(numbers.sum().sum())")
            await step_ok(env, "print(round(total, 3), len(numbers.columns))")
        await fill(source)
        forked = await asyncio.gather(*(timed(env.fork()) for env in envs))
        forks = [fork for _, fork in forked]
    finally:
        await asyncio.gather(*(env.close() for env in [*envs, *forks]), return_exceptions=True)
    return {"reset_ms": [ms for ms, _ in resets], "first_step_ms": [ms for ms, _ in steps],
            "fork_ms": [ms for ms, _ in forked]}


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(int(q * len(ordered)), len(ordered) - 1)], 1)


async def main(rounds: int, concurrencies: list[int]) -> dict[str, object]:
    sources = {"warm": load_source("notebook", {"pool_size": str(POOL_SIZE), "pool_refill_parallel": "2"}),
               "cold": load_source("notebook", {"pool_size": "0"})}
    for source in sources.values():
        source.start()
    results: dict[str, object] = {}
    try:
        await one_phase_set(sources["cold"], 1, 0)  # warm the page cache: the same files are read
        for concurrency in concurrencies:
            figures = {mode: {"reset_ms": [], "first_step_ms": [], "fork_ms": []} for mode in sources}
            before = sources["warm"].pool_stats()
            for round_ in range(rounds):
                for mode in (("warm", "cold") if round_ % 2 == 0 else ("cold", "warm")):
                    got = await one_phase_set(sources[mode], concurrency, round_)  # type: ignore[arg-type]
                    for name, values in got.items():
                        figures[mode][name] += values
                    progress(f"x{concurrency} round {round_} {mode}: " + ", ".join(
                        f"{name} p50 {statistics.median(values):.0f}" for name, values in got.items()))
            after = sources["warm"].pool_stats()
            summary = {mode: {"reset_p50_ms": p(f["reset_ms"], 0.5), "reset_p95_ms": p(f["reset_ms"], 0.95),
                              "first_step_p50_ms": p(f["first_step_ms"], 0.5), "fork_p50_ms": p(f["fork_ms"], 0.5),
                              "samples": len(f["reset_ms"])}
                       for mode, f in figures.items()}
            ratios = {f"{name}_p50_warm_over_cold": round(summary["warm"][f"{name}_p50_ms"]
                                                          / summary["cold"][f"{name}_p50_ms"], 3)
                      for name in ("reset", "first_step", "fork")}
            results[f"concurrent_{concurrency}"] = {
                **summary, **ratios,
                "pool_hits": after.hits - before.hits, "pool_misses": after.misses - before.misses,
                "goals_met": all(ratios[name] <= goal for name, goal in GOALS.items())}
    finally:
        for source in sources.values():
            await source.aclose()
    return {"rounds": rounds, "pool_size": POOL_SIZE, "preload": ["pandas", "numpy"], "sandbox": "bwrap",
            **results, "goals": GOALS, "cpus": os.cpu_count()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    arguments = parser.parse_args()
    print(json.dumps(asyncio.run(main(arguments.rounds, arguments.concurrency)), indent=2))
