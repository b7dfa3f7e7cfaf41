"""What the notebook sandbox costs an episode: Reset and first-step latency, sandboxed vs not, in
one run.

Both modes use the same environment and kernel code (env_servers.envs.notebook); only the
`sandbox` option differs: `bwrap` (own namespaces and limits) or `none` (the kernel runs as a
plain child process). Each round resets one episode of each mode, alternating which goes first,
then runs one cell (pandas reads the task's first CSV file) and closes it. Runs in this process,
no gRPC: the figures are the environment's own. Prints JSON with the medians and the ratios

  sandboxed reset p50 / unsandboxed reset p50          (goal <= 1.5)
  sandboxed first step p50 / unsandboxed first step p50

    python bench/sandbox.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before anything imports aviary
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aviary.core import ToolCall, ToolRequestMessage

from env_servers.catalog import load_source

MODES = ("bwrap", "none")


def progress(message: str) -> None:
    print(f"[sandbox] {message}", file=sys.stderr, flush=True)


# No kernel pool: every Reset boots its kernel, which is what the sandbox's cost is measured on
# (bench/notebook.py measures the pool).
SOURCES = {mode: load_source("notebook", {"sandbox": mode, "pool_size": "0"}) for mode in MODES}


async def one_episode(mode: str, index: int) -> tuple[float, float]:
    """Seconds to reset a notebook episode, and to run its first cell."""
    source = SOURCES[mode]
    index %= source.splits["test"]
    summary = source.task_summary("test", index)
    first_file = json.loads(summary["files"])[0]
    env = await source.make("test", index)
    try:
        started = time.perf_counter()
        await env.reset()
        reset_s = time.perf_counter() - started
        code = f"import pandas as pd\nprint(len(pd.read_csv({first_file!r})))"
        action = ToolRequestMessage(tool_calls=[ToolCall.from_name("edit_cell", contents=code)])
        started = time.perf_counter()
        observations, _, _, _ = await env.step(action)
        step_s = time.perf_counter() - started
        if "Error" in observations[0].content:
            raise RuntimeError(f"{mode}: the first cell failed: {observations[0].content[:500]}")
    finally:
        await env.close()
    return reset_s, step_s


async def main(rounds: int) -> dict[str, object]:
    figures: dict[str, dict[str, list[float]]] = {mode: {"reset_ms": [], "first_step_ms": []} for mode in MODES}
    await one_episode("bwrap", 0)  # warm the page cache for both: the same files are read
    for round_ in range(rounds):
        order = MODES if round_ % 2 == 0 else MODES[::-1]
        for mode in order:
            reset_s, step_s = await one_episode(mode, round_)
            figures[mode]["reset_ms"].append(reset_s * 1e3)
            figures[mode]["first_step_ms"].append(step_s * 1e3)
            progress(f"round {round_}: {mode} reset {reset_s * 1e3:.0f} ms, first step {step_s * 1e3:.0f} ms")
    medians = {mode: {name: round(statistics.median(values), 1) for name, values in series.items()}
               for mode, series in figures.items()}
    return {
        "rounds": rounds,
        "p50_ms": {"sandboxed": medians["bwrap"], "unsandboxed": medians["none"]},
        "ratio_reset": round(medians["bwrap"]["reset_ms"] / medians["none"]["reset_ms"], 3),
        "ratio_first_step": round(medians["bwrap"]["first_step_ms"] / medians["none"]["first_step_ms"], 3),
        "goal_reset_ratio": 1.5,
        "cpus": os.cpu_count(),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    arguments = parser.parse_args()
    print(json.dumps(asyncio.run(main(arguments.rounds)), indent=2))
