"""What a learner checkpoint holds besides the trainer's state: `learner_state.json`, the group
ids trained and dropped so far, where metrics.jsonl ended and the buffer counters, so that a
restarted learner counts no group twice. Written last, atomically: a checkpoint is complete only
once it exists (sciproto.rundir)."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel

from sciproto import rundir
from sciproto.rundir import LEARNER_STATE_FILE

# The highest-step checkpoint that holds both the trainer and the learner state: the one every
# reader of a run directory takes (sciproto.rundir).
latest_learner_checkpoint = rundir.latest_checkpoint


class LearnerState(BaseModel):
    """What a checkpoint adds to the trainer state so a restart counts no group twice."""

    trained_group_ids: list[str] = []
    # Groups a step dropped as stale (named in its step result): a resend is refused as duplicate.
    dropped_stale_group_ids: list[str] = []
    # Bytes of metrics.jsonl up to this checkpoint's step; a resumed learner cuts the file there
    # (None in checkpoints written before it was recorded: lines of later steps are dropped).
    metrics_bytes: int | None = None
    groups_received: int = 0
    groups_dropped_stale: int = 0
    groups_skipped_equal: int = 0
    groups_duplicate: int = 0


def read_learner_state(checkpoint: Path) -> LearnerState:
    """The learner state of a complete checkpoint (sciproto.rundir reads it), validated."""
    return LearnerState.model_validate(rundir.read_learner_state(checkpoint))


def write_learner_state(checkpoint: Path, state: LearnerState) -> None:
    """Write it beside the trainer state, by rename: the checkpoint counts only once this exists."""
    staging = checkpoint / f"{LEARNER_STATE_FILE}.tmp"
    staging.write_text(state.model_dump_json())
    os.replace(staging, checkpoint / LEARNER_STATE_FILE)


__all__ = ["LEARNER_STATE_FILE", "LearnerState", "latest_learner_checkpoint", "read_learner_state",
           "write_learner_state"]
