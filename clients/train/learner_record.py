"""What the learner of a run kept, read from its run directory once it has stopped: the final
checkpoint, the metrics lines up to it, and the groups it trained or dropped as stale.

`sciproto train` hears of a step through the TrainStep stream, but a stop (the time budget, Ctrl-C)
ends that stream while a step may still be training; the learner finishes that step, logs it and
checkpoints it before it exits. The run's summary is made to agree with this record, so the
summary, `metrics.jsonl` and the checkpoint name the same steps. Reads files only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sciproto.rundir import (
    METRICS_FILE,
    checkpoint_step,
    latest_checkpoint,
    read_learner_state,
    read_metrics,
)


@dataclass
class LearnerRecord:
    """The learner's durable record of a run."""

    checkpoint: Path
    step: int  # the optimizer step of `checkpoint`
    metrics: list[dict[str, Any]] = field(default_factory=list)  # lines of steps <= step, in order
    trained_group_ids: set[str] = field(default_factory=set)
    dropped_stale_group_ids: set[str] = field(default_factory=set)


def learner_record(run_dir: Path) -> LearnerRecord | None:
    """The record of the run's latest complete checkpoint; None when there is none."""
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        return None
    step = checkpoint_step(checkpoint) or 0
    state = read_learner_state(checkpoint)
    return LearnerRecord(
        checkpoint=checkpoint,
        step=step,
        metrics=[r for r in read_metrics(run_dir / METRICS_FILE) if int(r.get("step", 0)) <= step],
        trained_group_ids=set(state.get("trained_group_ids", [])),
        dropped_stale_group_ids=set(state.get("dropped_stale_group_ids", [])),
    )


__all__ = ["LearnerRecord", "learner_record"]
