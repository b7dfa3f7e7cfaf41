"""`sciproto train --config demo` as a real process: the tiny model must learn the toy task, with the
policy server and the learner taking turns on the cores (placement colocated): no step overlaps
generation, by the policy server's own clock."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sciproto.client.rollouts import read_rollouts

MIN_STEPS = 6  # enough for two separate windows
WINDOW = 3  # steps averaged at each end of the run


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_training_raises_the_reward(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "sciproto",
        "train",
        "--config",
        "demo",
        "--set",
        f"run.dir={tmp_path}",
        "--set",
        "run.name=e2e",
        "--set",
        "progress=false",
        "--set",
        "budget.max_seconds=480",
        "--set",
        "placement=colocated",
    ]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
    )
    try:
        output, _ = process.communicate(timeout=560)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)  # stops its servers too, unlike SIGKILL
        output, _ = process.communicate(timeout=180)
        pytest.fail(f"sciproto train overran its own budget:\n{output[-3000:]}")
    assert process.returncode == 0, output[-6000:]
    run_dir = tmp_path / "e2e"

    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "target_reward", summary["stopped_by"]
    trained = [s["step"] for s in summary["steps"]]
    assert len(trained) >= MIN_STEPS
    # A step still under way when the target was reached finishes and is counted like the others.
    assert [s["step"] for s in steps] == trained == list(range(1, len(trained) + 1))
    first = sum(s["reward_mean"] for s in steps[:WINDOW]) / WINDOW
    last = sum(s["reward_mean"] for s in steps[-WINDOW:]) / WINDOW
    assert first < 0.2, f"a random model should start low, got {first:.3f}"
    assert last > 0.8, f"reward rose only from {first:.3f} to {last:.3f}"
    assert all(s["policy_lag_max"] <= 1 for s in steps), "max_staleness 1 bounds the lag"

    # Colocated: each step and its push ran inside a hold of the policy server's generation, whose
    # bounds are the server's own wall clock (HoldResponse), the step's the learner's.
    assert "placement colocated: generation and the learner step take turns" in output
    assert summary["placement"] == "colocated"
    for s in steps:
        assert s["policy_held_s"] > 0, s
        assert s["policy_held_from_unix_s"] <= s["step_work_from_unix_s"] < s["step_work_until_unix_s"] \
            <= s["policy_held_until_unix_s"], f"step {s['step']} ran outside the policy server's hold"
    assert "generation held (learner step 1;" in (run_dir / "policy.log").read_text()
    held = summary["learner_seconds"]["policy_held_s"]
    assert summary["learner_seconds"]["train_s"] <= held, summary["learner_seconds"]
    # The policy server's rate alone, timed before the first rollout (2 groups of the run's 8
    # samples, at most 24 tokens each), and the run's own rate while it generated.
    calibration = summary["calibration"]
    assert (calibration["servers"], calibration["groups"], calibration["samples"]) == (1, 2, 8), calibration
    assert 0 < calibration["tokens"] <= 2 * 8 * 24 and calibration["tokens_per_s"] > 0, calibration
    assert summary["tokens_per_s_generating"] >= summary["tokens_per_s"] > 0
    # Every group generated is settled once or still pending: nothing lost or counted twice.
    assert summary["groups_generated"] == sum(summary["groups_settled"].values()) + summary["groups_pending"]

    assert (run_dir / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    checkpoint = max((run_dir / "checkpoints").glob("step_*"))
    assert int(checkpoint.name.removeprefix("step_")) == len(trained)
    assert summary["checkpoint"] == str(checkpoint)
    assert (checkpoint / "model.safetensors").is_file() and (
        checkpoint / "learner_state.json"
    ).is_file()
    rollouts = list(read_rollouts(run_dir / "rollouts.jsonl"))
    assert len(rollouts) >= len(trained) * 16 * 8
    assert len({r.rollout_id for r in rollouts}) == len(rollouts), "every rollout line is unique"


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_auto_dtype_and_precision_resolve_where_each_server_computes(tmp_path: Path) -> None:
    # `policy.dtype: auto` and `learner.grpo.precision: auto`: each server picks for its own device
    # (here both the CPU) and says why; the learner pushes what the policy server serves, and a
    # checkpoint evaluated with `checkpoint.dtype: auto` is served the same way.
    from sciproto.hardware import auto_dtype, auto_precision
    from sciproto.processes import start_server
    from tests.test_train_recovery_e2e import run_cli

    dtype, reason = auto_dtype("cpu")
    precision = auto_precision("cpu")[0]
    done = run_cli(f"run.dir={tmp_path}", "run.name=auto", "progress=false", "budget.max_steps=2",
                   "budget.target_reward=null", "policy.dtype=auto", "learner.grpo.precision=auto", timeout_s=300)
    assert done.returncode == 0, done.stderr[-4000:]
    run_dir = tmp_path / "auto"
    policy_log = (run_dir / "policy.log").read_text()
    learner_log = (run_dir / "learner.log").read_text()
    assert f"dtype auto: serving {dtype} ({reason})" in policy_log
    assert f"(transformers, {dtype})" in policy_log
    assert f"precision auto: {precision} compute ({reason})" in learner_log
    assert f"{precision} compute over fp32 weights" in learner_log and f"pushing {dtype} to" in learner_log
    assert json.loads((run_dir / "summary.json").read_text())["steps"][-1]["step"] == 2

    env = start_server(["serve", "env", "--env", "toy", "--port", "0"], timeout_s=120)
    try:
        evaluated = subprocess.run(
            [sys.executable, "-m", "sciproto", "eval", "--env", env.target, "--tasks", "toy:test", "--checkpoint",
             str(run_dir), "--limit", "2", "--output", str(tmp_path / "eval.json"), "--set", "checkpoint.dtype=auto"],
            capture_output=True, text=True, timeout=300, check=False)
    finally:
        env.stop(30)
    assert evaluated.returncode == 0, evaluated.stderr[-4000:]
    assert f"(transformers, {dtype})" in (tmp_path / "eval.policy.log").read_text()
