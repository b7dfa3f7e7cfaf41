"""What a run reports when it ends: a summary that agrees with what the learner kept, written to
summary.json beside metrics.jsonl and its plot, and printed as a table."""

from __future__ import annotations

import json
import logging
import math
import statistics
from pathlib import Path

from rich.console import Console
from rich.table import Table

from clients.train.learner_record import learner_record
from clients.train.records import StepRecord, TrainOutcome
from learner.metrics import plot_metrics
from sciproto.rundir import (
    METRICS_FILE,
    PLOT_FILE,
    ROLLOUTS_FILE,
    SUMMARY_FILE,
    latest_checkpoint,
    read_metrics,
)

log = logging.getLogger(__name__)


def settle_with_learner(outcome: TrainOutcome, run_dir: Path, resumed_at: int) -> None:
    """Make the summary agree with what the stopped learner kept (clients.train.learner_record): a step
    that was training when the run stopped finished after the TrainStep stream ended, so no step
    result told of it; its metrics line and the final checkpoint do. Steps the client heard of
    beyond that checkpoint (a learner killed between checkpoints) are lost and trained again by a
    resumed run: they leave the summary too. `resumed_at`: the step the run started from."""
    kept = learner_record(run_dir)
    if kept is None:
        return
    lost = [s.step for s in outcome.steps if s.step > kept.step]
    if lost:
        log.warning("steps %s are not in the learner's last checkpoint (step %d): a resumed run "
                    "trains them again", lost, kept.step)
    heard = {s.step: s for s in outcome.steps if s.step <= kept.step}
    for line in kept.metrics:
        step = int(line["step"])
        if step > resumed_at and step not in heard:  # finished after the stream ended
            sft = line.get("objective") == "sft"
            heard[step] = StepRecord(
                step=step,
                policy_version=int(line.get("policy_version", step)),
                reward_mean=math.nan if sft else float(line.get("reward_mean", math.nan)),
                objective="sft" if sft else "grpo",
                sft_loss=line.get("sft_loss"),
                sft_token_accuracy=line.get("sft_token_accuracy"),
                policy_lag_mean=float(line.get("policy_lag_mean", 0.0)),
                groups=int(line.get("groups", 0)),
                seconds=outcome.seconds,
            )
    outcome.steps = [heard[step] for step in sorted(heard)]
    for group_id, fates in outcome.group_fates.items():
        if fates != ["pending"]:
            continue
        fate = ("consumed" if group_id in kept.trained_group_ids
                else "dropped_stale" if group_id in kept.dropped_stale_group_ids else None)
        if fate is not None:
            fates[:] = [fate]
            outcome.groups_settled[fate] = outcome.groups_settled.get(fate, 0) + 1
            outcome.groups_pending -= 1
    outcome.checkpoint = str(kept.checkpoint)


def finish_outputs(outcome: TrainOutcome, run_dir: Path) -> None:
    records = read_metrics(run_dir / METRICS_FILE)
    if records:
        outcome.plot = str(plot_metrics(records, run_dir / PLOT_FILE, title=run_dir.name))
    outcome.metrics = str(run_dir / METRICS_FILE)
    outcome.learner_seconds = {key: round(sum(r.get(key) or 0.0 for r in records), 1) for key in LEARNER_PHASES
                               if any(key in r for r in records)}
    outcome.rollouts = str(run_dir / ROLLOUTS_FILE)
    if not outcome.checkpoint:
        latest = latest_checkpoint(run_dir)
        outcome.checkpoint = str(latest) if latest else ""
    summary = outcome.model_dump(mode="json") | {"tokens_per_s": outcome.tokens_per_s,
                                                 "tokens_per_s_generating": outcome.tokens_per_s_generating}
    (run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")


# The learner's phases, as metrics.jsonl times each step (summed in the summary).
LEARNER_PHASES = ("train_s", "weight_sync_s", "wait_rollouts_s", "policy_held_s")


def phases_row(outcome: TrainOutcome) -> str:
    seconds = outcome.learner_seconds
    row = " / ".join(f"{seconds.get(key, 0.0):.0f} s" for key in LEARNER_PHASES[:3])
    return row + (f"; generation held {seconds['policy_held_s']:.0f} s" if "policy_held_s" in seconds else "")


def calibration_row(outcome: TrainOutcome) -> str:
    """The run's rate while it generated against the policy servers' rate alone before it began."""
    alone, inside = outcome.calibration["tokens_per_s"], outcome.tokens_per_s_generating
    return f"{inside:.0f} / {alone:.0f}" + (f" ({inside / alone:.0%})" if alone > 0 else "")


def set_aside_row(outcome: TrainOutcome) -> str:
    counts = outcome.task_stats
    return (f"{counts['set_aside']} ({counts['set_aside_solved']} / {counts['set_aside_unsolved']}) /"
            f" {counts['passed_over']} / {counts['revisited']} ({counts.get('revisits_mixed', 0)} mixed"
            + (f", {counts['revisited_all_set_aside']} with every task set aside"
               if counts.get("revisited_all_set_aside") else "") + ")")


def print_summary(outcome: TrainOutcome, console: Console | None = None) -> None:
    table = Table(title=f"sciproto train: {outcome.run_dir}")
    table.add_column("figure")
    table.add_column("value", justify="right")
    steps = [s for s in outcome.steps if s.objective == "grpo"]
    sft = [s for s in outcome.steps if s.objective == "sft" and s.sft_loss is not None]
    # One step's batch reward is noisy (a few groups, different tasks): means of up to 5 steps.
    span = max(1, min(5, len(steps) // 2))
    first = f"{statistics.fmean(s.reward_mean for s in steps[:span]):.3f}" if steps else "-"
    last = f"{statistics.fmean(s.reward_mean for s in steps[-span:]):.3f}" if steps else "-"
    refused = ", ".join(f"{k} {v}" for k, v in sorted(outcome.groups_refused.items())) or "none"
    first_step = f"{outcome.first_step_s:.0f} s" if outcome.first_step_s is not None else "-"
    fates = outcome.groups_settled
    settled = (
        f"{fates.get('consumed', 0)} / {fates.get('dropped_stale', 0)} / {outcome.groups_pending}"
    )
    rows = [
        ("optimizer steps", str(outcome.steps[-1].step if outcome.steps else 0)),
        *([("sft steps: loss first -> last / token accuracy", (f"{len(sft)}: {sft[0].sft_loss:.3f} ->"
            f" {sft[-1].sft_loss:.3f} / {sft[-1].sft_token_accuracy or 0:.3f}"))] if sft else []),
        (f"reward, first -> last {span} step{'s' if span > 1 else ''}", f"{first} -> {last}"),
        ("time", f"{outcome.seconds / 60:.1f} min"),
        ("groups generated / refused", f"{outcome.groups_generated} / {refused}"),
        ("first optimizer step after", first_step),
        ("groups consumed / dropped stale / pending", settled),
        ("generation tokens/s", f"{outcome.tokens_per_s:.0f}"),
        ("generation idle", f"{outcome.generation_idle_s:.1f} s"),
        *([("generation tokens/s while generating / alone", calibration_row(outcome))]
          if outcome.calibration else []),
        *([("placement", outcome.placement)] if outcome.placement else []),
        *([("learner training / pushing / waiting for rollouts", phases_row(outcome))]
          if outcome.learner_seconds else []),
        *([("step groups / forks opened / closed", " / ".join(
            f"{outcome.step_groups[key]:.0f}" for key in ("step_groups", "forks_opened", "forks_closed")))]
          if outcome.step_groups else []),
        *([("tasks set aside (solved / unsolved) / turns passed over / revisited", set_aside_row(outcome))]
          if outcome.task_stats else []),
        ("stopped by", outcome.stopped_by),
        ("checkpoint", outcome.checkpoint or "-"),
        ("metrics", outcome.metrics),
        ("plot", outcome.plot or "-"),
        ("rollouts (sciproto view)", outcome.rollouts),
    ]
    for name, value in rows:
        table.add_row(name, value)
    (console or Console()).print(table)




__all__ = ["finish_outputs", "print_summary", "settle_with_learner"]
