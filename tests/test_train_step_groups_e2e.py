"""`sciproto train` with `rollout.grouping: step` as a real process (env, policy and learner
servers of its own): step groups are sampled on forks, each goes to the learner as one group, and
every fork is closed.

Two short runs: the notebook env with its state view (the case step groups are for; the random
tiny model never writes a valid tool call, so every branch scores 0 and each group is refused as
all-equal, which is accounted like any group), and toy, whose reward (the share of digits in the
reply) differs between branches, so the learner trains on non-zero step-group advantages.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from sciproto.client.rollouts import read_rollouts
from tests.conftest import NOTEBOOK_SANDBOX
from tests.test_train_recovery_e2e import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SMALL = ["progress=false", "budget.target_reward=null", "rollout.grouping=step", "rollout.sampling.max_tokens=12",
         "learner.batch_groups=2", "learner.buffer_capacity=8", "learner.checkpoint_every=0"]


def outputs(run_dir: Path) -> tuple[dict, list[dict]]:
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics_file = run_dir / "metrics.jsonl"
    lines = metrics_file.read_text().splitlines() if metrics_file.exists() else []
    return summary, [json.loads(line) for line in lines]


def test_notebook_state_view_step_groups_close_every_fork_and_keep_prompts_bounded(tmp_path: Path) -> None:
    done = run_cli(f"run.dir={tmp_path}", "run.name=nb", *SMALL, "env.envs=[notebook]",
                   f"env.env_options.notebook.sandbox={NOTEBOOK_SANDBOX}", "rollout.tasks=notebook:train",
                   "rollout.observation=state", "rollout.concurrency=4", "rollout.step_groups.group_size=2",
                   "rollout.step_groups.max_depth=3", "rollout.step_groups.fork_budget=6",
                   "budget.max_steps=null", "budget.max_seconds=6", timeout_s=200)
    assert done.returncode == 0, done.stderr[-4000:]
    summary, _ = outputs(tmp_path / "nb")
    forks = summary["step_groups"]
    assert forks["step_groups"] >= 2 and forks["forks_opened"] == forks["forks_closed"] == 2 * forks["step_groups"]
    assert forks["tasks_failed"] == 0
    # The state view: a turn's prompt is the instruction, the earlier actions in short and the
    # notebook, however many steps came before (at most 3 actions of 160 characters here).
    assert 2000 < forks["prompt_tokens_per_turn_mean"] <= forks["prompt_tokens_per_turn_max"] < 3200
    settled = summary["groups_settled"]
    assert sum(settled.values()) + summary["groups_pending"] == summary["groups_generated"] == forks["step_groups"]
    groups = defaultdict(list)
    for record in read_rollouts(tmp_path / "nb" / "rollouts.jsonl"):
        groups[record.group_id].append(record)
    assert all("/step" in group_id and len(records) == 2 for group_id, records in groups.items())
    later = [records for group_id, records in groups.items() if not group_id.endswith("/step0")]
    assert later, "some base rollout went past its first step"
    for records in later:  # a later step's prompt is the state view alone: one user message
        assert [m.role for m in records[0].messages] == ["user", "assistant"]


def test_toy_step_groups_train_on_non_zero_advantages(tmp_path: Path) -> None:
    done = run_cli(f"run.dir={tmp_path}", "run.name=toy", *SMALL, "rollout.concurrency=8",
                   "rollout.step_groups.group_size=4", "rollout.step_groups.max_depth=1",
                   "rollout.step_groups.fork_budget=4",
                   "budget.max_steps=2", "budget.max_seconds=120", timeout_s=200)
    assert done.returncode == 0, done.stderr[-4000:]
    summary, metrics = outputs(tmp_path / "toy")
    assert summary["stopped_by"] == "max_steps" and len(metrics) >= 2
    assert all(m["advantage_abs_mean"] > 0.5 and m["advantage_nonzero_frac"] > 0 for m in metrics), metrics
    assert all(m["prompt_tokens_per_turn_max"] > 0 for m in metrics)
    forks = summary["step_groups"]
    assert forks["forks_opened"] == forks["forks_closed"] == 4 * forks["step_groups"] > 0
    assert summary["steps"][-1]["forks_opened"] == summary["steps"][-1]["forks_closed"]
