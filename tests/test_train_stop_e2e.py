"""A run stopped while a step trains (by `budget.max_seconds`, or by Ctrl-C in a terminal) says
exactly what its learner kept: the summary's steps, metrics.jsonl and the final checkpoint agree.

The learner holds step 2 after training it (`learner.faults.hold_s`), so a step is in flight when
the stop comes: the client has heard of step 1 only, while the learner finishes step 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from sciproto.processes import sciproto_command

HOLD_LINE = "holding at after_train of step 2"


def _start(run_dir: Path, *overrides: str) -> subprocess.Popen[str]:
    settings = [f"run.dir={run_dir.parent}", f"run.name={run_dir.name}", "progress=false",
                "learner.faults.hold_at=after_train", "learner.faults.hold_step=2", *overrides]
    command = sciproto_command("train", "--config", "demo", *(a for s in settings for a in ("--set", s)))
    # A session of its own: SIGINT to its process group is what a terminal sends on Ctrl-C (a
    # background job of this shell would ignore SIGINT).
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True,
                            env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})


def _finish(process: subprocess.Popen[str], timeout_s: float) -> str:
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGTERM)  # stops its servers too
        output, _ = process.communicate(timeout=180)
        pytest.fail(f"sciproto train did not stop:\n{output[-3000:]}")
    assert process.returncode == 0, output[-6000:]
    return output


def _assert_agree(run_dir: Path) -> int:
    """The summary, metrics.jsonl and the final checkpoint name the same steps; returns how many."""
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    checkpoint = max(int(p.name.removeprefix("step_")) for p in (run_dir / "checkpoints").glob("step_*"))
    summary_steps = [s["step"] for s in summary["steps"]]
    assert (summary_steps, metrics, checkpoint) == (list(range(1, checkpoint + 1)),) * 2 + (checkpoint,), (
        f"summary {summary_steps}, metrics.jsonl {metrics}, checkpoint step_{checkpoint}")
    assert summary["checkpoint"].endswith(f"step_{checkpoint:08d}")
    # The groups the last step consumed are settled as consumed, not left pending.
    consumed = summary["groups_settled"].get("consumed", 0)
    assert consumed == sum(json.loads(line)["groups_consumed"]
                           for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    return checkpoint


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_run_stopped_by_max_seconds_during_a_step_counts_that_step(tmp_path: Path) -> None:
    run_dir = tmp_path / "deadline"
    # Step 2 is held 40 s after training: the 30 s budget runs out while it is in flight.
    process = _start(run_dir, "budget.max_seconds=30", "learner.faults.hold_s=40")
    output = _finish(process, timeout_s=360)
    assert HOLD_LINE in (run_dir / "learner.log").read_text(), output[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["stopped_by"] == "max_seconds"
    assert _assert_agree(run_dir) >= 2


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_run_interrupted_by_ctrl_c_during_a_step_counts_that_step(tmp_path: Path) -> None:
    run_dir = tmp_path / "interrupted"
    process = _start(run_dir, "budget.max_seconds=300", "learner.faults.hold_s=15")
    deadline = time.monotonic() + 240
    while HOLD_LINE not in _read(run_dir / "learner.log"):
        assert process.poll() is None and time.monotonic() < deadline, "step 2 was never held"
        time.sleep(0.5)
    os.killpg(process.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the foreground group
    output = _finish(process, timeout_s=240)
    assert "interrupted" in output
    assert json.loads((run_dir / "summary.json").read_text())["stopped_by"] == "interrupted"
    assert _assert_agree(run_dir) == 2


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_step_longer_than_the_stop_allows_is_interrupted_and_the_step_before_is_kept(tmp_path: Path) -> None:
    """A stop during a step that would outlast `processes.stop_timeout_s` (a big model on a small
    CPU): the learner interrupts that step at a micro-batch instead of being SIGKILLed, and still
    writes its final checkpoint, of the step before."""
    run_dir = tmp_path / "slow"
    # Step 2 waits 600 s before each micro-batch; the stop gives the learner 30 s (15 for the step).
    process = _start(run_dir, "budget.max_seconds=300", "learner.faults.hold_at=null",
                     "learner.faults.micro_batch_delay_s=600", "learner.checkpoint_every=0",
                     "processes.stop_timeout_s=30")
    deadline = time.monotonic() + 240
    while "slowing step 2" not in _read(run_dir / "learner.log"):
        assert process.poll() is None and time.monotonic() < deadline, "step 2 never started"
        time.sleep(0.5)
    os.killpg(process.pid, signal.SIGINT)
    _finish(process, timeout_s=240)
    log = _read(run_dir / "learner.log")
    assert "interrupting it" in log and "no final checkpoint" not in log, log[-3000:]
    assert _assert_agree(run_dir) == 1
