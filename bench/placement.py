"""Colocated against disaggregated placement of the policy server and the learner on this machine, in
one run; prints JSON.

For each placement, `bench/real_model.py --seconds S --set placement=P` (same config, seed and
held-out tasks; the base model is evaluated once and reused): optimizer steps and steps per hour,
generation tokens/s inside the run, the learner's mean step and push seconds, the seconds
generation was held (colocated), groups generated and refused as no signal, and the held-out
pass@1 gain with its interval. The ratios are colocated over disaggregated.

Output: {"config", "seconds", "placements": {"colocated": {...}, "disaggregated": {...}},
         "ratio_steps_per_hour", "ratio_generation_tokens_per_s", "gain_points": {...}}
Usage: python bench/placement.py [--config arith_smollm2_cpu] [--seconds 600] [--limit 100]
       [--order colocated disaggregated] [--output FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from sciproto.processes import lifeline_popen_options
from sciproto.rundir import METRICS_FILE, SUMMARY_FILE, read_metrics

PLACEMENTS = ("colocated", "disaggregated")


def progress(message: str) -> None:
    print(f"[placement bench] {message}", file=sys.stderr, flush=True)


def run_figures(run_dir: Path, seconds: float) -> dict[str, Any]:
    """What a run's summary and metrics say about where its time went."""
    summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    metrics = read_metrics(run_dir / METRICS_FILE)

    def total(key: str) -> float:
        return round(sum(m.get(key) or 0.0 for m in metrics), 1)

    def mean(key: str) -> float | None:
        values = [m[key] for m in metrics if isinstance(m.get(key), int | float)]
        return round(statistics.fmean(values), 2) if values else None

    steps = len(metrics)
    generated = summary.get("groups_generated") or 0
    refused = sum(m.get("groups_skipped_equal") or 0 for m in metrics)
    return {"steps": steps, "steps_per_hour": round(3600 * steps / seconds, 1),
            "generation_tokens_per_s": round(summary.get("tokens_per_s", 0.0), 1),
            "train_s_mean": mean("train_s"), "weight_sync_s_mean": mean("weight_sync_s"),
            "train_s_total": total("train_s"), "policy_held_s_total": total("policy_held_s"),
            "wait_rollouts_s_total": total("wait_rollouts_s"),
            "groups_generated": generated, "groups_no_signal": refused,
            "no_signal_fraction": round(refused / generated, 3) if generated else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="arith_smollm2_cpu")
    parser.add_argument("--seconds", type=float, default=600.0, help="Training budget of each placement")
    parser.add_argument("--limit", type=int, default=100, help="Held-out tasks evaluated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--order", nargs=2, default=list(PLACEMENTS), choices=PLACEMENTS,
                        help="Which placement trains first")
    parser.add_argument("--runs-dir", type=Path, default=Path("runs"))
    parser.add_argument("--output", type=Path, default=Path("runs/placement.json"))
    args = parser.parse_args()
    args.runs_dir.mkdir(parents=True, exist_ok=True)
    stamp = int(time.time())
    base_report: Path | None = None
    results: dict[str, Any] = {}
    for placement in args.order:
        name = f"placement-{placement}-{stamp}"
        out = args.runs_dir / f"{name}.json"
        progress(f"{placement}: bench/real_model.py --seconds {args.seconds:g} --set placement={placement}")
        command = [sys.executable, str(Path(__file__).with_name("real_model.py")), "--config", args.config,
                   "--seconds", str(args.seconds), "--limit", str(args.limit), "--seed", str(args.seed),
                   "--runs-dir", str(args.runs_dir), "--run-name", name, "--output", str(out), "--curve-every", "0",
                   "--set", f"placement={placement}"]
        if base_report is not None:
            command += ["--base-report", str(base_report)]
        subprocess.run(command, check=True, timeout=args.seconds * 3 + 3600, stdout=subprocess.DEVNULL,
                       **lifeline_popen_options())  # the run stops if this script is killed
        report = json.loads(out.read_text())
        base_report = base_report or args.runs_dir / f"{name}.base-eval.json"
        trained = report.get("trained") or {}
        results[placement] = {
            **run_figures(args.runs_dir / name, args.seconds),
            "base_pass@1": report["base"]["pass@1"], "trained_pass@1": trained.get("pass@1"),
            "trained_interval": [trained.get("low"), trained.get("high")], "gain_points": report.get("gain_points"),
        }
    colocated, apart = results["colocated"], results["disaggregated"]

    def ratio(key: str) -> float | None:
        return round(colocated[key] / apart[key], 3) if apart.get(key) else None

    result = {"config": args.config, "seconds": args.seconds, "held_out_tasks": args.limit, "order": args.order,
              "placements": results, "ratio_steps_per_hour": ratio("steps_per_hour"),
              "ratio_generation_tokens_per_s": ratio("generation_tokens_per_s"),
              "gain_points": {p: results[p]["gain_points"] for p in args.order}}
    text = json.dumps(result, indent=2)
    print(text)
    args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
