"""A run directory's latest complete checkpoint: every reader of a run directory agrees on it.

A checkpoint is saved into `step_N.tmp` and renamed `step_N`; the learner then writes its
`learner_state.json`, and only with that file does the checkpoint count. A learner killed between
those writes leaves a checkpoint folder without the file, or a staging folder: each caller below
must pass over both and take the last checkpoint that holds everything.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

COMPLETE, RENAMED_ONLY, STAGING = "step_00000002", "step_00000003", "step_00000004.tmp"


def write_checkpoint(run_dir: Path, name: str, learner_state: bool) -> Path:
    folder = run_dir / "checkpoints" / name
    folder.mkdir(parents=True)
    step = int(name.removeprefix("step_").removesuffix(".tmp"))
    (folder / "manifest.json").write_text(json.dumps({"step": step, "policy_version": step}))
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "trainer_state.pt").write_bytes(b"")
    if learner_state:
        (folder / "learner_state.json").write_text(json.dumps({"trained_group_ids": [f"toy/train/{step}#0"]}))
    return folder


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """Step 2 complete; step 3 renamed into place, its learner state not yet written; step 4 staged."""
    run = tmp_path / "run"
    write_checkpoint(run, "step_00000001", learner_state=True)
    write_checkpoint(run, COMPLETE, learner_state=True)
    write_checkpoint(run, RENAMED_ONLY, learner_state=False)
    write_checkpoint(run, STAGING, learner_state=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
    return run


def test_the_learner_resumes_from_the_latest_complete_checkpoint(run_dir: Path) -> None:
    from learner.service import latest_learner_checkpoint

    assert latest_learner_checkpoint(run_dir) == run_dir / "checkpoints" / COMPLETE


def test_the_trainer_checkpoints_agree(run_dir: Path) -> None:
    from learner.checkpoint import latest_checkpoint

    assert latest_checkpoint(run_dir) == run_dir / "checkpoints" / COMPLETE


def test_train_resumes_after_the_latest_complete_checkpoint(run_dir: Path) -> None:
    from clients.train.resume import (
        choose_run_dir,
        latest_checkpoint,
        trained_group_ids,
        trained_steps,
    )

    assert latest_checkpoint(run_dir) == run_dir / "checkpoints" / COMPLETE
    assert trained_steps(run_dir) == 2
    assert trained_group_ids(run_dir) == ["toy/train/2#0"]
    assert choose_run_dir(run_dir.parent, "run", resume=True) == run_dir


def test_the_learner_record_is_that_of_the_latest_complete_checkpoint(run_dir: Path) -> None:
    from clients.train.learner_record import learner_record

    record = learner_record(run_dir)
    assert record is not None and record.step == 2 and record.checkpoint == run_dir / "checkpoints" / COMPLETE
    assert [line["step"] for line in record.metrics] == [1, 2]


def test_the_summary_names_the_latest_complete_checkpoint(run_dir: Path) -> None:
    from clients.train.records import TrainOutcome
    from clients.train.summary import finish_outputs

    outcome = TrainOutcome(run_dir=str(run_dir))
    finish_outputs(outcome, run_dir)
    assert outcome.checkpoint == str(run_dir / "checkpoints" / COMPLETE)


def test_eval_of_a_run_directory_serves_the_latest_complete_checkpoint(run_dir: Path) -> None:
    from clients.eval import checkpoint_folder

    assert checkpoint_folder(run_dir) == run_dir / "checkpoints" / COMPLETE
    assert checkpoint_folder(run_dir / "checkpoints" / COMPLETE) == run_dir / "checkpoints" / COMPLETE
