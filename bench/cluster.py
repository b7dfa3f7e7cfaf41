"""Local processes vs Ray actors on the demo config; prints JSON with the speed ratio.

Runs `sciproto train` twice in this process, same config, seed and step budget: once with the
local engine (each server a child process) and once with the Ray engine on a local Ray started
here (each server an actor; the rollout client in this process either way). For each: time from
calling `train` to the first optimizer step (servers' start-up included: for Ray, actors, not
Ray's own start-up), optimizer steps per second between the first and the last step, and the
mean reward of the last steps. Ray's own start-up (`ray.init`) is timed on its own.
Output: {"local": {...}, "ray": {...}, "ray_init_s": ..., "steps_per_s_ratio_ray_over_local": ...,
         "first_step_ratio_ray_over_local": ...}. The goal is a steps/s ratio >= 0.9.
Usage: python bench/cluster.py [--steps 12] [--config demo] [--output FILE] [--set key=value] [--ray-cpus 3]

Ray reaches outside the machine when it starts (its dashboard asks the cloud metadata address which
cloud it runs on), so the script runs itself again in a network namespace whose only interface is
loopback (`unshare -n`, as scripts/test.sh runs the tests) when it is not in one; where that is not
permitted (not root, no CAP_SYS_ADMIN) it says so in one line and runs with the machine's network.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from clients.train import TrainOutcome, load_train_config, train
from clients.train.cluster import ClusterSettings
from clients.train.ray_engine import connect, import_ray

LAST_STEPS = 3  # steps averaged for "reward at the end"


def first_step_after(metrics: Path, started: float, done: threading.Event, seen: dict[str, float]) -> None:
    """Note when the run's first metrics line (its first optimizer step) appears."""
    while not done.is_set():
        if metrics.exists() and metrics.stat().st_size > 0:
            seen["first_step_s"] = time.monotonic() - started
            return
        time.sleep(0.05)


def run(config_name: str, overrides: list[str], run_dir: Path) -> dict[str, Any]:
    config = load_train_config(config_name, [*overrides, f"run.dir={run_dir}", "run.resume=false"])
    seen: dict[str, float] = {}
    done = threading.Event()
    started = time.monotonic()
    watcher = threading.Thread(target=first_step_after, daemon=True,
                               args=(run_dir / config.run.name / "metrics.jsonl", started, done, seen))
    watcher.start()
    outcome = train(config)
    done.set()
    return measure(outcome, time.monotonic() - started, seen.get("first_step_s", float("nan")))


def measure(outcome: TrainOutcome, wall_s: float, first_step_s: float) -> dict[str, Any]:
    steps = outcome.steps
    span = steps[-1].seconds - steps[0].seconds if len(steps) > 1 else float("nan")
    last = steps[-LAST_STEPS:]
    return {
        "steps": len(steps),
        "first_step_s": round(first_step_s, 2),
        "steps_per_s": (len(steps) - 1) / span if len(steps) > 1 and span > 0 else float("nan"),
        "wall_s": round(wall_s, 1),
        "reward_first": steps[0].reward_mean if steps else float("nan"),
        "reward_last": sum(s.reward_mean for s in last) / len(last) if last else float("nan"),
        "stopped_by": outcome.stopped_by,
    }


def isolate() -> None:
    """Run this script again in a loopback-only network namespace, unless it runs in one already."""
    if [name for _, name in socket.if_nameindex()] == ["lo"]:
        return
    if shutil.which("unshare") and shutil.which("ip") and subprocess.run(
            ["unshare", "-n", "true"], capture_output=True, check=False).returncode == 0:
        os.execvp("unshare", ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh",
                              sys.executable, *sys.argv])
    print("unshare -n is not permitted here (needs root or CAP_SYS_ADMIN): Ray runs with this machine's network",
          file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="Optimizer steps of each run")
    parser.add_argument("--config", default="demo")
    parser.add_argument("--output", type=Path, default=None, help="Also write the JSON here")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        help="Config override for both runs, key.path=value (repeatable)")
    parser.add_argument("--ray-cpus", type=int, default=3, help="CPUs of the local Ray (one per server)")
    args = parser.parse_args()
    isolate()
    logging.basicConfig(level=logging.WARNING)
    # Same steps in both runs: no early stop at the target reward.
    overrides = [*args.overrides, f"budget.max_steps={args.steps}", "budget.target_reward=null",
                 "budget.max_seconds=null", "progress=false"]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        results["local"] = run(args.config, overrides, Path(tmp) / "local")
        ray = import_ray()
        started = time.monotonic()
        connect(ray, ClusterSettings(num_cpus=args.ray_cpus))  # the local Ray a `--cluster ray` run starts
        results["ray_init_s"] = round(time.monotonic() - started, 2)
        try:
            results["ray"] = run(args.config, [*overrides, "cluster.engine=ray"], Path(tmp) / "ray")
        finally:
            ray.shutdown()
    results["steps_per_s_ratio_ray_over_local"] = round(results["ray"]["steps_per_s"] / results["local"]["steps_per_s"], 3)
    results["first_step_ratio_ray_over_local"] = round(results["ray"]["first_step_s"] / results["local"]["first_step_s"], 3)
    text = json.dumps(results, indent=2)
    print(text)
    if args.output is not None:
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
