"""A training run's directory: its layout, its checkpoints and which of them is complete.

    <run_dir>/
        config.yaml         the resolved training configuration (`sciproto train`)
        metrics.jsonl       one JSON object per optimizer step (learner.metrics documents the fields)
        reward.png          reward and policy lag against the step
        rollouts.jsonl      the rollouts trained on
        summary.json        what the run did (`sciproto train`)
        task_stats.json     per-task outcome statistics, a snapshot per step a checkpoint may need
        checkpoints/step_<step:08d>/
            model.safetensors   full weights, named as in the model's state dict
            trainer_state.pt    optimizer state, step, policy version, RNG states
            manifest.json       step, policy version, config, file names (readable without torch)
            learner_state.json  the groups trained and dropped so far, where metrics.jsonl ended

A checkpoint is written into `step_<step>.tmp` and renamed into place (`learner.checkpoint`);
the learner then writes its `learner_state.json`, last. A checkpoint is complete once it holds
both its manifest and that file: a learner stopped between the writes leaves a staging folder or
a folder without the learner state, and every reader (the learner resuming, `train` resuming and
summing up, `eval` of a run directory) passes over both through `latest_checkpoint`.

Reads and names files only: no torch, no learner.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

CHECKPOINTS_DIR = "checkpoints"
WEIGHTS_FILE = "model.safetensors"
TRAINER_STATE_FILE = "trainer_state.pt"
MANIFEST_FILE = "manifest.json"
LEARNER_STATE_FILE = "learner_state.json"
STAGING_SUFFIX = ".tmp"
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "reward.png"
ROLLOUTS_FILE = "rollouts.jsonl"
SUMMARY_FILE = "summary.json"
TASK_STATS_FILE = "task_stats.json"
CONFIG_FILE = "config.yaml"

_STEP_DIR = re.compile(r"step_(\d+)")


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    """Where the checkpoint of optimizer step `step` goes."""
    return checkpoints_dir(run_dir) / f"step_{step:08d}"


def staging_dir(checkpoint: Path) -> Path:
    """The folder a checkpoint is written into before it is renamed `checkpoint`."""
    return checkpoint.with_name(checkpoint.name + STAGING_SUFFIX)


def checkpoint_step(checkpoint: Path) -> int | None:
    """The optimizer step of a checkpoint folder's name; None for any other name (a staging folder)."""
    match = _STEP_DIR.fullmatch(checkpoint.name)
    return int(match.group(1)) if match else None


def is_checkpoint(path: Path) -> bool:
    """Whether `path` is a checkpoint folder whose trainer state is in place (its manifest)."""
    return (path / MANIFEST_FILE).is_file()


def is_complete(checkpoint: Path) -> bool:
    """Whether the checkpoint folder holds everything: its name, manifest and learner state."""
    return (checkpoint_step(checkpoint) is not None and is_checkpoint(checkpoint)
            and (checkpoint / LEARNER_STATE_FILE).is_file())


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step under `run_dir`, or None when there is none."""
    folder = checkpoints_dir(run_dir)
    if not folder.is_dir():
        return None
    complete = [(checkpoint_step(path), path) for path in folder.glob("step_*") if is_complete(path)]
    return max(complete)[1] if complete else None


def read_learner_state(checkpoint: Path) -> dict[str, Any]:
    """The learner state of a complete checkpoint, as JSON (`learner.service.LearnerState`)."""
    return json.loads((checkpoint / LEARNER_STATE_FILE).read_text(encoding="utf-8"))


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl (a torn last line from a crash is skipped)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


__all__ = [
    "CHECKPOINTS_DIR",
    "CONFIG_FILE",
    "LEARNER_STATE_FILE",
    "MANIFEST_FILE",
    "METRICS_FILE",
    "PLOT_FILE",
    "ROLLOUTS_FILE",
    "STAGING_SUFFIX",
    "SUMMARY_FILE",
    "TASK_STATS_FILE",
    "TRAINER_STATE_FILE",
    "WEIGHTS_FILE",
    "checkpoint_dir",
    "checkpoint_step",
    "checkpoints_dir",
    "is_checkpoint",
    "is_complete",
    "latest_checkpoint",
    "read_learner_state",
    "read_metrics",
    "staging_dir",
]
