"""`sciproto train` with `rollout.curriculum`: a real run (tiny model, toy env) trains on the listed tasks only."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from clients.curriculum import Curriculum
from sciproto.client.rollouts import read_rollouts


def test_train_cycles_over_the_curriculum_tasks_only(tmp_path: Path) -> None:
    curriculum = Curriculum(env="toy", split="train", indices=[5, 2]).write(tmp_path / "curriculum.json")
    command = [sys.executable, "-m", "sciproto", "train", "--config", "demo",
               "--set", f"run.dir={tmp_path}", "--set", "run.name=curriculum", "--set", "progress=false",
               "--set", f"rollout.curriculum={curriculum}", "--set", "budget.max_steps=1",
               "--set", "budget.max_seconds=240", "--set", "learner.batch_groups=3",
               "--set", "rollout.samples=2", "--set", "rollout.concurrency=6"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=400, check=False,
                          env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rollouts = list(read_rollouts(tmp_path / "curriculum" / "rollouts.jsonl"))
    assert len(rollouts) >= 6
    assert {r.index for r in rollouts} == {2, 5}
    # Cycled in the file's order, epoch by epoch: 5#0, 2#0, 5#1, ...
    assert {r.group_id for r in rollouts} >= {"toy/train/5#0", "toy/train/2#0", "toy/train/5#1"}
