"""A resumed run takes exactly the step an uninterrupted run takes."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from learner_fixtures import MEASURED, make_group, tiny_model

from learner.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from learner.config import GRPOConfig
from learner.trainer import GRPOTrainer
from sciproto.rundir import checkpoint_dir


def _batches(seed: int) -> list:
    rng = random.Random(seed)
    return [
        [make_group(rng, [1.0, 0.0, 0.5], group_id=f"{step}-{g}") for g in range(2)]
        for step in range(3)
    ]


def test_resume_gives_the_same_next_step(tmp_path: Path) -> None:
    config = GRPOConfig(lr=1e-2)
    batches = _batches(seed=7)

    uninterrupted = GRPOTrainer(tiny_model(seed=0), config)
    for batch in batches[:2]:
        uninterrupted.train_step(batch)
    expected = uninterrupted.train_step(batches[2])

    first = GRPOTrainer(tiny_model(seed=0), config)
    first.train_step(batches[0])
    save_checkpoint(first, tmp_path)
    first.train_step(batches[1])
    saved = save_checkpoint(first, tmp_path)
    assert saved == checkpoint_dir(tmp_path, 2)
    # The trainer's part alone: complete once the learner service adds its learner_state.json.
    assert latest_checkpoint(tmp_path) is None
    manifest = json.loads((saved / "manifest.json").read_text())
    assert manifest["step"] == 2 and manifest["policy_version"] == 2

    # A different initialisation proves the weights come from the checkpoint.
    resumed = GRPOTrainer(tiny_model(seed=99), config)
    load_checkpoint(resumed, saved)
    assert (resumed.step, resumed.policy_version) == (2, 2)
    got = resumed.train_step(batches[2])

    assert got.model_dump(exclude=MEASURED) == expected.model_dump(exclude=MEASURED)
    for (name, a), b in zip(
        uninterrupted.state_dict_for_push().items(), resumed.state_dict_for_push().values()
    ):
        assert torch.equal(a, b), name


def test_latest_checkpoint_ignores_partial_saves(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    (tmp_path / "checkpoints" / "step_00000009.tmp").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_00000010").mkdir()  # no manifest: never finished
    assert latest_checkpoint(tmp_path) is None
    with pytest.raises(FileNotFoundError, match="not a checkpoint"):
        load_checkpoint(GRPOTrainer(tiny_model(), GRPOConfig()), tmp_path / "checkpoints")
