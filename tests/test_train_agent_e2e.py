"""`sciproto train` with `rollout.agent`: an external agent program (the official `openai` SDK, in
processes of its own) plays the toy tasks through a gateway on the run's policy server; its
sessions, graded by the env's Verify, are the groups the learner trains on."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from sciproto.client.rollouts import read_rollouts
from tests.test_train_recovery_e2e import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

AGENT = Path(__file__).resolve().parents[1] / "examples" / "openai_agent.py"


def test_an_external_agent_trains_to_the_demos_target(tmp_path: Path) -> None:
    """The demo as it ships (16 groups of 8 a step, target 0.9 over 3 steps), played by the
    example agent program: 128 runs a step, each a fork of a fork server that imported the openai
    SDK once (`preload`). The agent samples at its own temperature (the gateway's default, 1.0),
    not rollout.sampling's 0.7: each call's sampling is recorded and trained under, so the
    learner's pi_old / mu stays 1 for the weights that sampled (mismatch_engine)."""
    agent = f"rollout.agent={{command: '{sys.executable} {AGENT}', timeout_s: 120, preload: [openai, openai.resources, httpcore]}}"
    done = run_cli(f"run.dir={tmp_path}", "run.name=agent", "progress=false", "budget.max_seconds=1200", agent,
                   "rollout.sampling.temperature=0.7", timeout_s=1400)
    assert done.returncode == 0, done.stderr[-4000:]
    run_dir = tmp_path / "agent"
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert summary["stopped_by"] == "target_reward", (summary["stopped_by"], [m["reward_mean"] for m in metrics])
    assert metrics[0]["reward_mean"] < 0.2 and sum(m["reward_mean"] for m in metrics[-3:]) / 3 >= 0.9
    assert all(m["groups"] == 16 for m in metrics), metrics
    engine = [m["mismatch_engine"] for m in metrics if m["mismatch_engine"] is not None]
    assert engine and all(value < 1.01 for value in engine), engine
    # Every group generated is accounted once: settled by the learner or still pending at the end.
    settled = summary["groups_settled"]
    assert sum(settled.values()) + summary["groups_pending"] == summary["groups_generated"] >= 16 * len(metrics)
    groups = defaultdict(list)
    for record in read_rollouts(run_dir / "rollouts.jsonl"):
        groups[record.group_id].append(record)
    assert len(groups) == summary["groups_generated"]
    sessions = set()
    for group_id, records in groups.items():
        assert group_id.startswith("toy/train/") and len(records) == 8
        for record in records:  # one gateway session each, one call, graded by Verify
            assert record.status == "SCORED" and record.steps == 1 and sum(record.loss_mask) > 0
            assert [tuple(span[2:]) for span in record.sampling_spans] == [(1.0, 1.0, 0)], record.sampling_spans
            assert record.task["segments"] == "1" and 0.0 <= record.reward <= 1.0
            sessions.add(record.task["session"])
    assert len(sessions) == 8 * len(groups)


def test_an_agent_program_that_is_not_there_is_refused_before_anything_starts(tmp_path: Path) -> None:
    done = run_cli(f"run.dir={tmp_path}", "rollout.agent={command: no-such-agent run.py}", timeout_s=60)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "no program 'no-such-agent' on PATH" in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "demo").exists()


def test_an_agent_program_that_fails_every_run_stops_the_run_with_its_error(tmp_path: Path) -> None:
    """A command that starts but never works (a script that is not there, a module the interpreter
    lacks) stops the run with the program's own error, not a run to the budget of refused groups."""
    done = run_cli(f"run.dir={tmp_path}", "progress=false", "budget.max_seconds=120",
                   f"rollout.agent={{command: '{sys.executable} {tmp_path}/no_such_agent.py'}}", timeout_s=200)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "failed on every run" in done.stderr and "no_such_agent.py" in done.stderr, done.stderr[-3000:]



def test_a_preload_module_the_interpreter_lacks_stops_the_run_with_the_import_error(tmp_path: Path) -> None:
    done = run_cli(f"run.dir={tmp_path}", "progress=false", "budget.max_seconds=120",
                   f"rollout.agent={{command: '{sys.executable} {AGENT}', preload: [openai, no_such_sdk]}}",
                   timeout_s=200)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "import no_such_sdk failed: ModuleNotFoundError" in done.stderr, done.stderr[-3000:]
    assert len([line for line in done.stderr.splitlines() if "error" in line.lower()]) <= 2, done.stderr[-3000:]
    assert not (tmp_path / "demo").exists()  # refused before the run's directory and servers

def test_a_run_stopped_with_agent_programs_in_flight_ends_them_quietly(tmp_path: Path) -> None:
    """The time budget ends a run whose agent programs are all still running: each is killed and
    waited for before the run's event loop closes, so nothing is left running and asyncio has
    nothing to complain about after the summary."""
    marker = f"sciproto-test-agent-{tmp_path.name}"
    sleeper = f"{sys.executable} -c 'import time; time.sleep(600)' {marker}"
    done = run_cli(f"run.dir={tmp_path}", "progress=false", "budget.max_seconds=20", "rollout.concurrency=32",
                   f"rollout.agent={{command: \"{sleeper}\", timeout_s: 300}}", timeout_s=200)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "demo" / "summary.json").read_text())["stopped_by"] == "max_seconds"
    for noise in ("Traceback", "is closed", "Task was destroyed", "Exception ignored"):
        assert noise not in done.stderr, done.stderr[-4000:]
    left = subprocess.run(["pgrep", "-f", marker], check=False, capture_output=True, text=True, timeout=30)
    assert left.stdout == "", f"agent programs outlived the run: {left.stdout}"
