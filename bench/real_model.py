"""A real pretrained model learns a real task on this machine: held-out pass@1 before and after training.

1. Starts an env server for the held-out tasks' env and a policy server with the config's base
   model (SmolLM2-135M-Instruct for the default config), and evaluates it greedily on the first
   `--limit` tasks of the held-out split (the training split's test twin, e.g.
   gsm8k:short_text_test for short_text_train; `sciproto eval`'s `clients.eval.evaluate`, with
   the train config's turn and token budgets).
2. Stops that policy server and runs `sciproto train --config CONFIG` for `--seconds` (a child
   process; its screen goes to `<run dir>.train.out`).
3. Evaluates the run's final checkpoint the same way (a policy server serving its weights), and
   with `--curve-every N` (default 8) the checkpoints the run saved every N steps too: the
   learning curve, and the seconds into the run of the first checkpoint 30 points above the base.
   Each SmolLM2 checkpoint takes about 1.6 GB of disk and a few seconds of the run to write.

Output JSON: {"base": {"pass@1", "low", "high", ...}, "trained": {...}, "gain_points": ...,
"gain_beyond_intervals": trained.low > base.high, "gain_points_per_100_groups" (the gain over the
groups the run generated), "curve": [{step, seconds, groups_consumed, pass@1, low, high, gain_points}]
(every checkpoint, the last one the trained model), "seconds_to_gain_30" (the first checkpoint's
time at or past +30 points; null if none was, or if only the final checkpoint was evaluated),
"train": {steps, seconds, groups_generated, generation tokens/s over the run, while generating
and alone before it (the run's calibration), training tokens/s, ...}, "seed", ...}; the ratio is
trained over base pass@1. Greedy decoding makes both evaluations deterministic for given weights;
the training run is seeded (`learner.grpo.seed`, `rollout.sampling.seed`) but its timing on a
shared machine is not, so two runs differ.
Usage: python bench/real_model.py [--config arith_smollm2_cpu] [--seconds 1800] [--limit 100] [--curve-every 8]
       [--eval-tasks ENV:SPLIT] [--base-report FILE (reuse a base evaluation)] [--output FILE] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from clients.collect import CollectError, parse_tasks
from clients.eval import (
    EvalConfig,
    EvalReport,
    checkpoint_adapter,
    eval_config_for_run,
    evaluate,
    serve_checkpoint,
)
from clients.train import load_train_config
from sciproto.processes import lifeline_popen_options, sciproto_command, start_server, watch_parent
from sciproto.rundir import MANIFEST_FILE, METRICS_FILE, SUMMARY_FILE, checkpoints_dir, read_metrics


def held_out_tasks(train_tasks: str) -> str:
    """The held-out split of a training split, by name: gsm8k:short_text_train -> gsm8k:short_text_test."""
    if not train_tasks.endswith("train"):
        raise SystemExit(f"rollout.tasks {train_tasks!r} does not end in 'train': pass --eval-tasks ENV:SPLIT")
    return train_tasks.removesuffix("train") + "test"


def summary_of(report: EvalReport) -> dict:
    greedy = report.passes["greedy"]
    estimate = greedy.pass_at["pass@1"]
    return {"pass@1": estimate.value, "low": estimate.low, "high": estimate.high, "tasks": estimate.tasks,
            "mean_reward": greedy.mean_reward, "end_reasons": greedy.end_reasons,
            "completion_tokens_mean": greedy.completion_tokens.mean, "policy": report.policy,
            "policy_version": report.policy_version, "eval_seconds": report.seconds}


async def evaluate_base(env_target: str, config: EvalConfig, limit: int, tasks: str, output: Path) -> EvalReport:
    policy = await asyncio.to_thread(start_server, ["serve", "policy", "--model", config.checkpoint.model or "smollm2",
                                                    "--port", "0", "--set", f"dtype={config.checkpoint.dtype}"],
                                     timeout_s=600, log_file=output.with_name(output.stem + ".base-policy.log"))
    try:
        return await evaluate([env_target], [policy.target], tasks, limit=limit, greedy=True, samples=0,
                              concurrency=32, config=config, output=output)
    finally:
        await asyncio.to_thread(policy.stop, 60)


async def evaluate_checkpoint(env_target: str, checkpoint: Path, config: EvalConfig, limit: int, tasks: str,
                              output: Path) -> EvalReport:
    async with serve_checkpoint(checkpoint, config.checkpoint, output.with_name(output.stem + ".policy.log")) as (
            target, label):
        return await evaluate([env_target], [target], tasks, limit=limit, greedy=True, samples=0, concurrency=32,
                              config=config, output=output, policy_label=label, adapter=checkpoint_adapter(checkpoint))


def train_figures(run_dir: Path) -> dict:
    summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    metrics = read_metrics(run_dir / METRICS_FILE)

    def mean_of(key: str) -> float | None:
        values = [m[key] for m in metrics if isinstance(m.get(key), int | float)]
        return round(statistics.fmean(values), 2) if values else None

    steps = summary.get("steps", [])
    return {"steps": len(steps), "seconds": round(summary.get("seconds", 0.0), 1),
            "stopped_by": summary.get("stopped_by"), "groups_generated": summary.get("groups_generated"),
            "first_step_s": steps[0]["seconds"] if steps else None,
            "reward_first_step": steps[0]["reward_mean"] if steps else None,
            "reward_last_steps": round(statistics.fmean(s["reward_mean"] for s in steps[-3:]), 4) if steps else None,
            "generation_tokens_per_s": round(summary.get("tokens_per_s", 0.0), 2),
            "generation_tokens_per_s_generating": round(summary.get("tokens_per_s_generating", 0.0), 2),
            "generation_tokens_per_s_alone": (summary.get("calibration") or {}).get("tokens_per_s"),
            "generation_tokens_per_s_learner_mean": mean_of("tokens_per_s_generation"),
            "training_tokens_per_s_mean": mean_of("tokens_per_s_training"),
            "checkpoint": summary.get("checkpoint"), "run_dir": str(run_dir)}


def learning_curve(run_dir: Path, base: dict, evaluated: list[tuple[Path, dict]]) -> list[dict]:
    """Each evaluated checkpoint's step, its time into the run and the groups trained by then (from
    the run's metrics), and its held-out pass@1 and gain over `base` (`summary_of` each), in step order."""
    metrics = {m["step"]: m for m in read_metrics(run_dir / METRICS_FILE)}
    steps = {s["step"]: s for s in json.loads((run_dir / SUMMARY_FILE).read_text()).get("steps", [])}
    points = []
    for checkpoint, figures in evaluated:
        step = int(json.loads((checkpoint / MANIFEST_FILE).read_text())["step"])
        points.append({"step": step, "seconds": round(steps[step]["seconds"], 1) if step in steps else None,
                       "groups_consumed": sum(m.get("groups_consumed") or 0 for s, m in metrics.items() if s <= step),
                       "pass@1": figures["pass@1"], "low": figures["low"], "high": figures["high"],
                       "gain_points": round(100 * (figures["pass@1"] - base["pass@1"]), 1)})
    return sorted(points, key=lambda point: point["step"])


def seconds_to_gain(curve: list[dict], points: float) -> float | None:
    """The time into the run of the first checkpoint on `curve` at or past `points` of gain. None if
    no checkpoint got there, or if the curve is the final checkpoint alone (`--curve-every 0`): that
    the run ended past the gain says it got there some time before its end, not when."""
    if len(curve) < 2:
        return None
    return next((point["seconds"] for point in curve if point["gain_points"] >= points), None)


def run_training(config: str, seconds: float, run_name: str, runs_dir: Path, seed: int, overrides: list[str],
                 curve_every: int = 0) -> Path:
    run_dir = runs_dir / run_name
    if curve_every:  # before the caller's overrides, which may set it otherwise
        overrides = [f"learner.checkpoint_every={curve_every}", *overrides]
    command = sciproto_command("train", "--config", config, "--set", f"run.name={run_name}",
                               "--set", f"run.dir={runs_dir}", "--set", f"budget.max_seconds={seconds}",
                               "--set", f"learner.grpo.seed={seed}", "--set", f"rollout.sampling.seed={seed}",
                               *(arg for o in overrides for arg in ("--set", o)))
    screen = runs_dir / f"{run_name}.train.out"
    runs_dir.mkdir(parents=True, exist_ok=True)
    with screen.open("w") as out:
        # The budget stops the run; the slack covers server start-up and the final checkpoint.
        # The lifeline stops the run (and its servers) if this script is killed.
        subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=seconds + 1200, check=True,
                       **lifeline_popen_options())
    return run_dir


async def main_async(args: argparse.Namespace) -> dict:
    config = eval_config_for_run(args.config, args.overrides)
    tasks = args.eval_tasks or held_out_tasks(load_train_config(args.config, args.overrides).rollout.tasks)
    out_dir = args.runs_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    run_name = args.run_name or f"real-model-{int(time.time())}"
    try:
        env_name, _ = parse_tasks(tasks)
    except CollectError:
        raise SystemExit(f"--eval-tasks {tasks!r} must look like ENV:SPLIT, e.g. gsm8k:short_text_test") from None
    env = await asyncio.to_thread(start_server, ["serve", "env", "--env", env_name, "--port", "0"], timeout_s=300)
    try:
        if args.base_report:
            base = EvalReport.model_validate_json(args.base_report.read_text())
        else:
            base = await evaluate_base(env.target, config, args.limit, tasks, out_dir / f"{run_name}.base-eval.json")
            (out_dir / f"{run_name}.base-eval.json").write_text(base.model_dump_json(by_alias=True, indent=2))
        run_dir = await asyncio.to_thread(run_training, args.config, args.seconds, run_name, out_dir, args.seed,
                                          args.overrides, args.curve_every)
        figures = train_figures(run_dir)
        trained = None
        earlier: list[tuple[Path, EvalReport]] = []
        if figures["checkpoint"]:  # a run that took no optimizer step saves none: nothing to compare
            trained = await evaluate_checkpoint(env.target, Path(figures["checkpoint"]), config, args.limit, tasks,
                                                out_dir / f"{run_name}.trained-eval.json")
            (out_dir / f"{run_name}.trained-eval.json").write_text(trained.model_dump_json(by_alias=True, indent=2))
            for checkpoint in sorted(checkpoints_dir(run_dir).glob("step_*")):
                if checkpoint != Path(figures["checkpoint"]) and (checkpoint / MANIFEST_FILE).is_file():
                    output = out_dir / f"{run_name}.{checkpoint.name}-eval.json"
                    report = await evaluate_checkpoint(env.target, checkpoint, config, args.limit, tasks, output)
                    output.write_text(report.model_dump_json(by_alias=True, indent=2))
                    earlier.append((checkpoint, report))
    finally:
        await asyncio.to_thread(env.stop, 30)
    before = summary_of(base)
    if trained is None:
        return {"config": args.config, "eval_tasks": f"{tasks} (first {args.limit}, greedy)", "seed": args.seed,
                "train_budget_s": args.seconds, "base": before, "trained": None,
                "note": "the run took no optimizer step (no checkpoint): the trained model is the base model",
                "train": figures}
    after = summary_of(trained)
    curve = learning_curve(run_dir, before, [(checkpoint, summary_of(report)) for checkpoint, report in
                                             [*earlier, (Path(figures["checkpoint"]), trained)]])
    return {"config": args.config, "eval_tasks": f"{tasks} (first {args.limit}, greedy)", "seed": args.seed,
            "train_budget_s": args.seconds, "base": before, "trained": after,
            "gain_points": round(100 * (after["pass@1"] - before["pass@1"]), 1),
            "curve": curve,
            "seconds_to_gain_30": seconds_to_gain(curve, 30),
            "gain_points_per_100_groups": (round(100 * 100 * (after["pass@1"] - before["pass@1"])
                                                 / figures["groups_generated"], 2)
                                           if figures.get("groups_generated") else None),
            "gain_beyond_intervals": after["low"] > before["high"],
            "ratio_trained_over_base": round(after["pass@1"] / before["pass@1"], 3) if before["pass@1"] else None,
            "train": figures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="arith_smollm2_cpu")
    parser.add_argument("--seconds", type=float, default=1800.0, help="Training budget (wall clock)")
    parser.add_argument("--limit", type=int, default=100, help="Held-out tasks evaluated")
    parser.add_argument("--eval-tasks", default=None,
                        help="Held-out ENV:SPLIT (default: the training split with 'train' replaced by 'test')")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs-dir", type=Path, default=Path("runs"))
    parser.add_argument("--run-name", default=None)
    parser.add_argument("--base-report", type=Path, default=None, help="Reuse this base evaluation (JSON)")
    parser.add_argument("--curve-every", type=int, default=8,
                        help="Checkpoint every N steps and evaluate each (the learning curve); 0: the last only")
    parser.add_argument("--output", type=Path, default=None, help="Also write the JSON here")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="Train config override")
    args = parser.parse_args()
    watch_parent()  # started by another bench (placement.py, lora.py): stop when it is gone
    result = asyncio.run(main_async(args))
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")
    sys.exit(0)


if __name__ == "__main__":
    main()
