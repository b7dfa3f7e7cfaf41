"""SmolLM2 learns to use the calculator: base, after SFT on demonstrations, after GRPO, on GSM8K's
tool-call splits (greedy pass@1 with intervals, the share of replies holding a well-formed tool
call, tool calls per episode).

1. Starts a gsm8k env server and writes the demonstrations the config's sft phase reads
   (`clients.demonstrations`: the first `--short-demos` tasks of gsm8k:short_train and every task
   of gsm8k:train, played through the env server in SmolLM2's tokens, kept when scored 1.0),
   interleaved so each SFT batch mixes one-step and multi-step problems.
2. Evaluates the base model greedily on the first `--limit` tasks of gsm8k:short_test and of the
   multi-step gsm8k:test (the train config's turn and token budgets).
3. Runs `sciproto train --config CONFIG` (the sft phase, then GRPO until `budget.max_seconds`;
   its screen goes to `<run dir>.train.out`).
4. Evaluates the checkpoint where the sft phase ended and the final one, on both splits.

Output JSON: {"base" | "sft" | "grpo": {split: {"pass@1", "low", "high", "tool_call_reply_frac",
"tool_calls_mean", ...}}, "grpo_gain_beyond_intervals": {split: grpo.low > sft.high},
"grpo_vs_sft_paired": {split: {"fixed", "broken", "p"}}, "demonstrations": {...}, "train": {...}}.
Both checkpoints run the same tasks greedily, so the paired comparison (the tasks GRPO solves that
SFT did not, and the reverse, with the exact two-sided sign test) tells a real difference from
chance where two intervals of 60 tasks (about +-0.12 each) still overlap.
Usage: python bench/real_model_tools.py [--config gsm8k_tools_smollm2_cpu] [--limit 100] [--short-demos 200]
       [--base-limit N] [--reuse-demos] [--seconds S (budget.max_seconds)] [--output FILE] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

from clients.demonstrations import collect_demonstrations
from clients.eval import EvalConfig, EvalReport, eval_config_for_run, evaluate, serve_checkpoint
from clients.train import load_train_config
from sciproto.client.rollouts import read_rollouts
from sciproto.processes import lifeline_popen_options, sciproto_command, start_server
from sciproto.rundir import METRICS_FILE, SUMMARY_FILE, checkpoint_dir, read_metrics

SPLITS = ("gsm8k:short_test", "gsm8k:test")


def figures(report: EvalReport) -> dict:
    greedy = report.passes["greedy"]
    estimate = greedy.pass_at["pass@1"]
    return {"pass@1": estimate.value, "low": estimate.low, "high": estimate.high, "tasks": estimate.tasks,
            "tool_call_reply_frac": greedy.tool_call_reply_frac, "tool_calls_mean": greedy.tool_calls.mean,
            "tool_calls_by_name": greedy.tool_calls_by_name, "turns_mean": greedy.turns.mean,
            "end_reasons": greedy.end_reasons, "completion_tokens_mean": greedy.completion_tokens.mean,
            "policy_version": report.policy_version, "eval_seconds": report.seconds}


async def evaluate_splits(env: str, policy: str, config: EvalConfig, limit: int, out: Path, label: str,
                          policy_label: str | None = None) -> dict:
    result = {}
    for tasks in SPLITS:
        output = out / f"{label}.{tasks.split(':')[1]}.eval.json"
        report = await evaluate([env], [policy], tasks, limit=limit, greedy=True, samples=0, concurrency=32,
                                config=config, output=output, policy_label=policy_label)
        output.write_text(report.model_dump_json(by_alias=True, indent=2))
        result[tasks.split(":")[1]] = figures(report)
        print(f"[bench] {label} {tasks}: pass@1 {result[tasks.split(':')[1]]['pass@1']}", file=sys.stderr, flush=True)
    return result


async def evaluate_base(env: str, config: EvalConfig, limit: int, out: Path) -> dict:
    policy = await asyncio.to_thread(start_server, ["serve", "policy", "--model", config.checkpoint.model or "smollm2",
                                                    "--port", "0", "--set", f"dtype={config.checkpoint.dtype}"],
                                     timeout_s=600, log_file=out / "base-policy.log")
    try:
        return await evaluate_splits(env, policy.target, config, limit, out, "base")
    finally:
        await asyncio.to_thread(policy.stop, 60)


async def evaluate_checkpoint(env: str, checkpoint: Path, config: EvalConfig, limit: int, out: Path,
                              label: str) -> dict:
    async with serve_checkpoint(checkpoint, config.checkpoint, out / f"{label}-policy.log") as (target, name):
        return await evaluate_splits(env, target, config, limit, out, label, policy_label=name)


def paired(before: Path, after: Path, success: float = 1.0) -> dict:
    """Two greedy evaluations of the same tasks (their rollouts JSONL), compared task by task.

    fixed  = tasks `after` solves and `before` did not;  broken = the reverse
    p      = P(a split at least this uneven | both equally good), two-sided:
             min(1, 2 * sum_{i <= min(fixed, broken)} C(n, i) / 2^n),  n = fixed + broken
    (McNemar's exact test: tasks both solve or both fail say nothing about which is better.)
    """
    solved = [{r.index: r.reward >= success for r in read_rollouts(path)}
              for path in (before, after)]
    if solved[0].keys() != solved[1].keys():
        raise ValueError(f"{before} and {after} hold different tasks: a paired comparison needs the same ones")
    fixed = sum(1 for task, was in solved[0].items() if not was and solved[1][task])
    broken = sum(1 for task, was in solved[0].items() if was and not solved[1][task])
    n = fixed + broken
    tail = sum(math.comb(n, i) for i in range(min(fixed, broken) + 1)) / 2 ** n
    # Three significant figures: 16 fixed and none broken is p = 3.05e-05, not 0.0.
    return {"tasks": len(solved[0]), "fixed": fixed, "broken": broken, "p": float(f"{min(1.0, 2 * tail):.3g}")}


async def write_demonstrations(env: str, path: Path, short_demos: int) -> dict:
    """One-step and multi-step demonstrations, interleaved, in `path` (rewritten)."""
    parts = [path.with_suffix(".short_train.jsonl"), path.with_suffix(".train.jsonl")]
    counts = {}
    for part, (split, limit) in zip(parts, [("short_train", short_demos), ("train", None)]):
        part.unlink(missing_ok=True)
        summary = await collect_demonstrations(env, "smollm2", "gsm8k", split, part, limit=limit)
        counts[split] = summary.as_dict()
    lines = [[r.to_json_line() for r in read_rollouts(part)] for part in parts]
    path.write_text("".join(line for pair in itertools.zip_longest(*lines) for line in pair if line))
    tokens = [len(r.token_ids) for r in read_rollouts(path)]
    return {**counts, "kept": len(tokens), "tokens_mean": round(statistics.fmean(tokens), 1), "tokens_max": max(tokens)}


def run_training(config: str, run_dir: Path, overrides: list[str]) -> None:
    command = sciproto_command("train", "--config", config, "--fresh", "--set", f"run.name={run_dir.name}",
                               "--set", f"run.dir={run_dir.parent}", *(a for o in overrides for a in ("--set", o)))
    with run_dir.with_suffix(".train.out").open("w") as out:
        subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=4 * 3600, check=True,
                       **lifeline_popen_options())  # the run stops if this script is killed


def train_figures(run_dir: Path) -> dict:
    summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    metrics = read_metrics(run_dir / METRICS_FILE)
    sft = [m for m in metrics if m.get("objective") == "sft"]
    grpo = [m for m in metrics if m.get("objective") != "sft"]
    generated, no_signal = summary.get("groups_generated") or 0, summary.get("groups_refused", {}).get("no_signal", 0)
    return {"steps": len(metrics), "sft_steps": len(sft), "grpo_steps": len(grpo),
            "seconds": round(summary.get("seconds", 0.0), 1), "stopped_by": summary.get("stopped_by"),
            "sft_loss_first_last": [round(sft[0]["sft_loss"], 4), round(sft[-1]["sft_loss"], 4)] if sft else None,
            "sft_token_accuracy_last": round(sft[-1]["sft_token_accuracy"], 4) if sft else None,
            "sft_seconds": round(sft[-1]["time_s"], 1) if sft else None,
            "grpo_reward_per_step": [round(m["reward_mean"], 3) for m in grpo],
            # Groups whose rewards were all equal are refused when they reach the learner, so no
            # batch holds one (its frac_all_equal_groups stays 0): the run's summary counts them.
            "groups_generated": generated, "groups_no_signal": no_signal,
            "groups_no_signal_frac": round(no_signal / generated, 3) if generated else None,
            "checkpoint": summary.get("checkpoint"),
            "run_dir": str(run_dir)}


async def main_async(args: argparse.Namespace) -> dict:
    overrides = list(args.overrides) + ([f"budget.max_seconds={args.seconds}"] if args.seconds else [])
    train = load_train_config(args.config, overrides)
    config = eval_config_for_run(args.config, overrides)
    sft_phase = next(p for p in train.phases if p.objective == "sft")
    out = args.runs_dir / (args.run_name or f"tools-{int(time.time())}")
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    env = await asyncio.to_thread(start_server, ["serve", "env", "--env", "gsm8k", "--port", "0"], timeout_s=300)
    try:
        assert sft_phase.demonstrations is not None and sft_phase.steps is not None
        sft_phase.demonstrations.parent.mkdir(parents=True, exist_ok=True)
        if args.reuse_demos and sft_phase.demonstrations.is_file():
            tokens = [len(r.token_ids) for r in read_rollouts(sft_phase.demonstrations)]
            demonstrations = {"kept": len(tokens), "tokens_mean": round(statistics.fmean(tokens), 1), "reused": True}
        else:
            demonstrations = await write_demonstrations(env.target, sft_phase.demonstrations, args.short_demos)
        print(f"[bench] demonstrations {demonstrations}", file=sys.stderr, flush=True)
        base_limit = args.limit if args.base_limit is None else args.base_limit
        base = await evaluate_base(env.target, config, base_limit, out) if base_limit else None
        run_dir = out / "run"
        await asyncio.to_thread(run_training, args.config, run_dir, overrides)
        trained = train_figures(run_dir)
        # The checkpoint where the sft phase ended; a run stopped inside it has only its final one.
        final = Path(trained["checkpoint"])
        sft_checkpoint = checkpoint_dir(run_dir, sft_phase.steps)
        if not trained["grpo_steps"]:
            sft_checkpoint = final
        sft = await evaluate_checkpoint(env.target, sft_checkpoint, config, args.limit, out, "sft")
        grpo = (await evaluate_checkpoint(env.target, final, config, args.limit, out, "grpo")
                if trained["grpo_steps"] else None)
    finally:
        await asyncio.to_thread(env.stop, 30)
    return {
        "config": args.config, "eval": f"first {args.limit} tasks of {', '.join(SPLITS)}, greedy (base: first"
                                        f" {args.base_limit or args.limit})",
        "base": base, "sft": sft, "grpo": grpo,
        "sft_gain_beyond_intervals": {s: sft[s]["low"] > base[s]["high"] for s in base} if base else None,
        "grpo_gain_beyond_intervals": {s: grpo[s]["low"] > sft[s]["high"] for s in sft} if grpo else None,
        "grpo_vs_sft_paired": {s: paired(out / f"sft.{s}.eval.greedy.jsonl", out / f"grpo.{s}.eval.greedy.jsonl",
                                         config.success_reward) for s in sft} if grpo else None,
        "demonstrations": demonstrations, "train": trained, "bench_seconds": round(time.monotonic() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="gsm8k_tools_smollm2_cpu")
    parser.add_argument("--limit", type=int, default=100, help="Tasks evaluated per split (test has 60)")
    parser.add_argument("--base-limit", type=int, default=None, help="Tasks per split for the base model (default:"
                        " --limit; 0: skip); it writes no tool call and uses every turn, so it is the slowest to"
                        " evaluate")
    parser.add_argument("--reuse-demos", action="store_true", help="Keep the demonstrations file when it exists")
    parser.add_argument("--short-demos", type=int, default=200, help="Demonstrations from gsm8k:short_train")
    parser.add_argument("--seconds", type=float, default=None, help="Training budget (budget.max_seconds)")
    parser.add_argument("--runs-dir", type=Path, default=Path("runs"))
    parser.add_argument("--run-name", default=None)
    parser.add_argument("--output", type=Path, default=None, help="Also write the JSON here")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="Train config override")
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
