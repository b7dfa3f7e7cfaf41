"""`sciproto train` with phases as real processes: demonstrations written by `sciproto demonstrate`
train the tiny model by SFT, then GRPO takes over; the run stops at the phase boundary and a
resumed run goes straight on with GRPO, sending no demonstration again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sciproto.client.rollouts import read_rollouts
from sciproto.processes import sciproto_command, start_server

SFT_STEPS = 3
BATCH_GROUPS = 4


def _train(config: Path, run_dir: Path, max_steps: int) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "sciproto", "train", "--config", str(config), "--set", f"run.dir={run_dir.parent}",
         "--set", f"run.name={run_dir.name}", "--set", "progress=false", "--set", f"budget.max_steps={max_steps}"],
        capture_output=True, text=True, timeout=540, check=False,
        env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_sft_then_grpo_switches_phase_and_resumes_across_the_boundary(tmp_path: Path) -> None:
    demos = tmp_path / "demos.jsonl"
    env = start_server(["serve", "env", "--env", "toy", "--port", "0"])
    try:
        made = subprocess.run(sciproto_command("demonstrate", "--env", env.target, "--model", "tiny", "--tasks",
                                               "toy:train", "--limit", "6", "--output", str(demos)),
                              capture_output=True, text=True, timeout=300, check=False)
    finally:
        env.stop()
    assert made.returncode == 0, made.stderr[-3000:]
    assert len(list(read_rollouts(demos))) == 6

    config = tmp_path / "phases.yaml"
    config.write_text(yaml.safe_dump({
        "run": {"name": "phases"},
        "budget": {"max_steps": SFT_STEPS + 2, "max_seconds": 480},
        "env": {"envs": ["toy"]},
        "policy": {"model": "tiny", "transformers": {"batch_window_s": 0.02}},
        "learner": {"batch_groups": BATCH_GROUPS, "buffer_capacity": 16, "push_every": 1, "checkpoint_every": 1,
                    "grpo": {"lr": 5.0e-3, "sft_lr": 3.0e-4, "max_staleness": 1}},
        "rollout": {"tasks": "toy:train", "samples": 8, "concurrency": 64, "max_steps": 1, "max_tokens": 512,
                    "sampling": {"temperature": 1.0, "max_tokens": 24}},
        "processes": {"policy_threads": 1, "learner_threads": 1},
        # 6 demonstrations, 3 steps of 4 groups: 12 groups, each demonstration twice.
        "phases": [{"objective": "sft", "demonstrations": str(demos), "steps": SFT_STEPS}, {"objective": "grpo"}],
    }))
    run_dir = tmp_path / "phases"

    first = _train(config, run_dir, max_steps=SFT_STEPS)  # stops at the boundary
    assert [s["step"] for s in first["steps"]] == [1, 2, 3]
    assert [s["objective"] for s in first["steps"]] == ["sft"] * SFT_STEPS
    assert first["demonstrations_sent"] == SFT_STEPS * BATCH_GROUPS

    second = _train(config, run_dir, max_steps=SFT_STEPS + 2)  # resumed: GRPO from step 4
    assert second["demonstrations_sent"] == 0, "every demonstration was trained before the resume"
    assert [s["objective"] for s in second["steps"]] == ["grpo", "grpo"]
    assert [s["step"] for s in second["steps"]] == [4, 5]
    # Generation speed counts from the phase switch (nothing was left to send: at once).
    assert 0 < second["sft_seconds"] < second["seconds"]
    assert second["tokens_per_s"] == second["completion_tokens"] / (second["seconds"] - second["sft_seconds"])

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    sft, grpo = metrics[:SFT_STEPS], metrics[SFT_STEPS:]
    assert all(m["objective"] == "sft" and m["groups"] == BATCH_GROUPS and m["tokens"] > 0 for m in sft)
    assert all(m["sft_loss"] > 0 and 0 <= m["sft_token_accuracy"] <= 1 for m in sft)
    assert sft[-1]["sft_loss"] < sft[0]["sft_loss"], "the demonstrations' loss falls"
    assert all(m["objective"] == "grpo" and m["sft_loss"] is None and "reward_mean" in m for m in grpo)
    assert max(int(p.name.removeprefix("step_")) for p in (run_dir / "checkpoints").glob("step_*")) == 5
