"""`sciproto train` reruns: resume by default, `--fresh` (run.resume=false) to start over, the step
budget exact. Real processes, the demo config made small. (A run that made no step saves no
checkpoint: tests/test_train_recovery_e2e.py::test_a_stalled_run_says_why.)"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from sciproto.processes import sciproto_command

SMALL = ["--set", "progress=false", "--set", "learner.batch_groups=4", "--set", "rollout.samples=4",
         "--set", "budget.target_reward=null"]


def train(tmp_path: Path, run_name: str, *args: str) -> dict:
    """Run `sciproto train` to its end; the summary it wrote in tmp_path/run_name."""
    command = sciproto_command("train", "--config", "demo", "--set", f"run.dir={tmp_path}",
                               "--set", "run.name=r", *SMALL, *args)
    result = subprocess.run(command, capture_output=True, text=True, timeout=400, check=False,
                            env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = tmp_path / run_name / "summary.json"
    assert summary.is_file(), f"no {summary}; output:\n{result.stderr[-3000:]}"
    return json.loads(summary.read_text())


def checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step_")) for p in (run_dir / "checkpoints").glob("step_*"))


def task_stats(run_dir: Path, step: int) -> dict:
    """The per-task statistics snapshot of `step` (clients.train.task_stats)."""
    snapshots = json.loads((run_dir / "task_stats.json").read_text())["snapshots"]
    return next(s["tasks"] for s in snapshots if s["step"] == step)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_rerun_resumes_with_new_groups_only_and_stops_at_the_step_budget(tmp_path: Path) -> None:
    first = train(tmp_path, "r", "--set", "budget.max_steps=2")
    run_dir = tmp_path / "r"
    assert first["run_dir"] == str(run_dir)
    assert [s["step"] for s in first["steps"]] == [1, 2]
    assert checkpoint_steps(run_dir) == [2], "max_steps=2 trains exactly 2 steps"
    # Every group generated has one fate or is pending, and counts once in its task's statistics,
    # whose snapshot for the checkpoint's step is what the run ended with.
    assert sum(first["groups_settled"].values()) + first["groups_pending"] == first["groups_generated"]
    at_2 = task_stats(run_dir, 2)
    assert sum(t["groups"] for t in at_2.values()) == first["task_stats"]["groups"] == first["groups_generated"]

    second = train(tmp_path, "r", "--set", "budget.max_steps=4")
    assert second["run_dir"] == str(run_dir), "a rerun continues the run that holds a checkpoint"
    assert [s["step"] for s in second["steps"]] == [3, 4]
    assert "duplicate" not in second["groups_refused"], second["groups_refused"]
    assert checkpoint_steps(run_dir) == [2, 4], "the budget is exact: no fifth step"
    # The rerun restored step 2's statistics exactly and added its own groups to them.
    at_4 = task_stats(run_dir, 4)
    assert second["task_stats"]["groups"] == first["groups_generated"] + second["groups_generated"]
    assert all(at_4[task]["groups"] >= record["groups"] for task, record in at_2.items())
    metrics = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics == [1, 2, 3, 4]
    state = json.loads((run_dir / "checkpoints" / "step_00000004" / "learner_state.json").read_text())
    assert len(state["trained_group_ids"]) == 16 == len(set(state["trained_group_ids"]))

    # The same budget again: nothing left to do, said at once, nothing started.
    again = subprocess.run(sciproto_command("train", "--config", "demo", "--set", f"run.dir={tmp_path}",
                                            "--set", "run.name=r", *SMALL, "--set", "budget.max_steps=4"),
                           capture_output=True, text=True, timeout=200, check=False,
                           env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    assert again.returncode == 1 and "trained 4 steps already" in again.stderr, again.stderr[-2000:]
    assert "--fresh" in again.stderr


def test_fresh_starts_in_the_next_free_numbered_directory_and_resume_in_the_latest_checkpointed(
        tmp_path: Path) -> None:
    from clients.train.resume import choose_run_dir
    from sciproto.rundir import LEARNER_STATE_FILE, MANIFEST_FILE, checkpoint_dir

    assert choose_run_dir(tmp_path, "r", resume=True) == tmp_path / "r"  # nothing there yet
    checkpoint_dir(tmp_path / "r", 2).mkdir(parents=True)
    (checkpoint_dir(tmp_path / "r", 2) / MANIFEST_FILE).write_text("{}")
    assert choose_run_dir(tmp_path, "r", resume=True) == tmp_path / "r-2"  # not complete: a fresh directory
    (checkpoint_dir(tmp_path / "r", 2) / LEARNER_STATE_FILE).write_text("{}")
    assert choose_run_dir(tmp_path, "r", resume=True) == tmp_path / "r"
    assert choose_run_dir(tmp_path, "r", resume=False) == tmp_path / "r-2"
    (tmp_path / "r-2").mkdir()  # a fresh run that made no step: no checkpoint
    assert choose_run_dir(tmp_path, "r", resume=True) == tmp_path / "r"
    assert choose_run_dir(tmp_path, "r", resume=False) == tmp_path / "r-3"


def test_resume_point_continues_after_the_trained_groups() -> None:
    from clients.train.resume import ResumePoint, resume_point
    from sciproto.client.rollouts import TaskKey

    trained = ["toy/train/0#0", "toy/train/1#0", "toy/train/0#1", "gsm8k/test/5#3", "toy/other/2#0"]
    point = resume_point(trained, "toy", "train", size=2)
    assert point == ResumePoint(start=3, epochs={TaskKey("toy", "train", 0): 2, TaskKey("toy", "train", 1): 1},
                                trained=3)
    unbounded = resume_point(["toy/train/7#0", "toy/train/3#0"], "toy", "train", size=None)
    assert unbounded.start == 8
