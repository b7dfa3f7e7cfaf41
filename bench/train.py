"""Synchronous vs asynchronous GRPO on the demo config; prints JSON with the speed ratio.

Runs `sciproto train` three times in this process, same config and seeds, each for the same
wall-clock budget:
  - sync  (max_staleness 0, one batch ahead): generation waits while the learner trains;
  - async (max_staleness 1 and 2, K + 1 batches ahead): generation goes on during training.
For each: optimizer steps, wall-clock seconds per step (between the first and the last step
result, so server start-up is left out), seconds the rollout client had nothing generating, and
the mean reward of the last steps when the budget ran out.
Generation and training get CPU cores of their own, the same in every mode: the policy server,
the env server and this process (the rollout client) run on `--generation-cpus`, the learner on
`--training-cpus` (taskset / os.sched_setaffinity). On separate devices overlapping the two is the
point of async GRPO; sharing every core between them would hide it. `--generation-cpus ""`
turns pinning off.
Output: {"sync_k0": {...}, "async_k1": {...}, "async_k2": {...}, "cpus": {...},
         "steps_per_s_ratio_k1_over_sync": ..., "reward_gain_k1_over_sync": ..., ...}.
Usage: python bench/train.py [--seconds 100] [--config demo] [--output FILE] [--set key=value]
                             [--generation-cpus 0] [--training-cpus 1]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

from clients.train import TrainOutcome, load_train_config, train

MODES = {"sync_k0": 0, "async_k1": 1, "async_k2": 2}
LAST_STEPS = 3  # steps averaged for "reward at the end"


def measure(outcome: TrainOutcome, budget_s: float) -> dict[str, float | int]:
    steps = outcome.steps
    span = steps[-1].seconds - steps[0].seconds if len(steps) > 1 else float("nan")
    last = steps[-LAST_STEPS:]
    return {
        "steps": len(steps),
        "seconds_per_step": span / (len(steps) - 1) if len(steps) > 1 else float("nan"),
        "steps_per_s": (len(steps) - 1) / span if len(steps) > 1 and span > 0 else float("nan"),
        "generation_idle_s": round(outcome.generation_idle_s, 2),
        "generation_idle_fraction": round(outcome.generation_idle_s / outcome.seconds, 3),
        "reward_first": steps[0].reward_mean if steps else float("nan"),
        "reward_at_budget": sum(s.reward_mean for s in last) / len(last) if last else float("nan"),
        "policy_lag_mean": sum(s.policy_lag_mean for s in steps) / len(steps)
        if steps
        else float("nan"),
        "generation_tokens_per_s": round(outcome.tokens_per_s, 1),
        "budget_s": budget_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seconds", type=float, default=100.0, help="Wall-clock budget of each run"
    )
    parser.add_argument("--config", default="demo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None, help="Also write the JSON here")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        help="Config override for every run, key.path=value (repeatable)",
    )
    parser.add_argument("--generation-cpus", default="0",
                        help="Cores of the policy and env servers and the rollout client, e.g. 0 or 0,1")
    parser.add_argument("--training-cpus", default="1", help="Cores of the learner")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    generation = [int(c) for c in args.generation_cpus.split(",") if c]
    training = [int(c) for c in args.training_cpus.split(",") if c]
    pinning = []
    if generation and training:
        os.sched_setaffinity(0, generation)  # the rollout client runs in this process
        pinning = [f"processes.env_cpus={generation}", f"processes.policy_cpus={generation}",
                   f"processes.learner_cpus={training}"]

    results: dict[str, object] = {"cpus": {"generation": generation, "training": training,
                                           "machine": os.cpu_count()}}
    with tempfile.TemporaryDirectory(prefix="sciproto-bench-") as runs:
        for name, staleness in MODES.items():
            config = load_train_config(
                args.config,
                [
                    f"run.dir={runs}",
                    f"run.name={name}",
                    "progress=false",
                    "budget.max_steps=null",
                    "budget.target_reward=null",
                    f"budget.max_seconds={args.seconds}",
                    f"learner.grpo.max_staleness={staleness}",
                    "learner.checkpoint_every=0",
                    f"policy.seed={args.seed}",
                    f"learner.grpo.seed={args.seed}",
                    *pinning,
                    *args.overrides,
                ],
            )
            print(f"{name}: {args.seconds:.0f} s ...", file=sys.stderr, flush=True)
            results[name] = measure(train(config), args.seconds)
    sync = results["sync_k0"]
    for name in ("async_k1", "async_k2"):
        run = results[name]
        results[f"steps_per_s_ratio_{name.removeprefix('async_')}_over_sync"] = round(
            run["steps_per_s"] / sync["steps_per_s"], 3
        )  # type: ignore[index,operator]
        results[f"reward_gain_{name.removeprefix('async_')}_over_sync"] = round(
            run["reward_at_budget"] - sync["reward_at_budget"], 3
        )  # type: ignore[index,operator]
    text = json.dumps(results, indent=2)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
