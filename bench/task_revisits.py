"""Which set-aside task a revisit generates, measured: `rollout.task_filter.revisit` in_turn against
promising, each resuming the same finished run for the same time.

A run whose tasks are mostly set aside (every sample solved, or none, in their last groups) spends
its generation on revisits. This script copies a finished run's latest checkpoint and task
statistics into two run directories and resumes each with `sciproto train` for `--seconds`: the
first with `revisit=in_turn` (the set-aside task whose turn it is), the second with
`revisit=promising` (the set-aside task whose record gives a group the best chance of mixed
rewards, clients.train.task_stats). Both start from the same weights, optimizer state and
statistics; nothing else differs.

Output JSON: {"from", "seconds", "arms": {arm: {"groups_generated", "groups_no_signal",
"groups_with_signal_per_100", "grpo_steps", "revisits", "revisits_mixed", "revisits_mixed_frac",
"tasks", "most_groups_of_one_task", "tokens_per_s"}}, "ratio": {figure: promising / in_turn}}.
Revisits still in flight at the stop count in `revisits` and not in `revisits_mixed`.
Usage: python bench/task_revisits.py --from runs/<name>/run [--seconds 600] [--out runs/revisits]
       [--output FILE] [--set key=value ...]
(`--from` is a run of bench/real_model_tools.py or `sciproto train`, with a checkpoint.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

from clients.train.task_stats import TaskStats, restore_task_stats
from sciproto.client.rollouts import read_rollouts
from sciproto.processes import lifeline_popen_options, sciproto_command
from sciproto.rundir import (
    METRICS_FILE,
    ROLLOUTS_FILE,
    SUMMARY_FILE,
    TASK_STATS_FILE,
    latest_checkpoint,
    read_metrics,
)

ARMS = ("in_turn", "promising")


def link_or_copy(source: str, target: str) -> None:
    """A checkpoint's files are written once: a hard link shares them without 1.7 GB of copying."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def prepare(source: Path, arm_dir: Path) -> None:
    """`arm_dir`: the source run's config, task statistics and latest checkpoint, nothing else."""
    checkpoint = latest_checkpoint(source)
    if checkpoint is None:
        raise SystemExit(f"{source} holds no complete checkpoint: give --from a run that saved one")
    shutil.rmtree(arm_dir, ignore_errors=True)
    (arm_dir / "checkpoints").mkdir(parents=True)
    for name in ("config.yaml", TASK_STATS_FILE):
        shutil.copy2(source / name, arm_dir / name)
    shutil.copytree(checkpoint, arm_dir / "checkpoints" / checkpoint.name, copy_function=link_or_copy)


def resume(arm_dir: Path, arm: str, seconds: float, overrides: list[str]) -> None:
    settings = [f"run.dir={arm_dir.parent}", f"run.name={arm_dir.name}", "run.resume=true",
                f"budget.max_seconds={seconds}", f"rollout.task_filter.revisit={arm}", *overrides]
    command = sciproto_command("train", "--config", str(arm_dir / "config.yaml"),
                               *(a for s in settings for a in ("--set", s)))
    print(f"[bench] {arm}: resuming {arm_dir} for {seconds:.0f} s", file=sys.stderr, flush=True)
    with arm_dir.with_suffix(".train.out").open("w") as out:
        subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=seconds + 1800, check=True,
                       **lifeline_popen_options())  # the run stops if this script is killed


def figures(arm_dir: Path, before: TaskStats) -> dict:
    summary = json.loads((arm_dir / SUMMARY_FILE).read_text())
    generated = summary.get("groups_generated") or 0
    no_signal = summary.get("groups_refused", {}).get("no_signal", 0)
    counts = summary.get("task_stats", {})
    revisits = counts.get("revisited", 0) - before.revisited
    mixed = counts.get("revisits_mixed", 0) - before.revisits_mixed
    # How widely the arm spread its groups: the distinct tasks, and the most groups one task had.
    groups = {(r.env, r.split, r.index, r.group_id) for r in read_rollouts(arm_dir / ROLLOUTS_FILE)}
    per_task = Counter(group[:3] for group in groups)
    return {
        "groups_generated": generated, "groups_no_signal": no_signal,
        "groups_with_signal_per_100": round(100 * (generated - no_signal) / generated, 1) if generated else None,
        "grpo_steps": len(read_metrics(arm_dir / METRICS_FILE)),
        "revisits": revisits, "revisits_mixed": mixed,
        "revisits_mixed_frac": round(mixed / revisits, 3) if revisits else None,
        "tasks": len(per_task), "most_groups_of_one_task": max(per_task.values(), default=0),
        "tokens_per_s": summary.get("tokens_per_s"),
        "stopped_by": summary.get("stopped_by"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="source", type=Path, required=True,
                        help="A finished run directory with a checkpoint and task_stats.json")
    parser.add_argument("--seconds", type=float, default=600.0, help="Each arm's budget.max_seconds")
    parser.add_argument("--out", type=Path, default=Path("runs/revisits"), help="Where the two arms' runs go")
    parser.add_argument("--output", type=Path, default=None, help="Also write the JSON here")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="Train config override")
    args = parser.parse_args()
    source = args.source.resolve()
    before = TaskStats()
    if restore_task_stats(before, source) is None:
        raise SystemExit(f"{source} holds no task statistics for its latest checkpoint ({TASK_STATS_FILE})")
    arms = {}
    for arm in ARMS:
        arm_dir = args.out.resolve() / arm / "run"
        prepare(source, arm_dir)
        resume(arm_dir, arm, args.seconds, args.overrides)
        arms[arm] = figures(arm_dir, before)
        print(f"[bench] {arm}: {arms[arm]}", file=sys.stderr, flush=True)
    ratio = {key: round(arms["promising"][key] / arms["in_turn"][key], 3)
             for key in ("groups_with_signal_per_100", "grpo_steps", "revisits_mixed_frac")
             if arms["in_turn"][key] and arms["promising"][key] is not None}
    result = {"from": str(source), "seconds": args.seconds, "set_aside_at_start": before.summary()["set_aside"],
              "tasks_at_start": len(before.tasks), "arms": arms, "ratio": ratio}
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
