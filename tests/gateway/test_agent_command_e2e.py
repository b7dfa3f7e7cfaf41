"""`sciproto agent-collect`: an external agent program (the `openai` SDK, in its own process) over
the toy env's tasks, through the gateway; its runs graded by the env server's Verify."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from sciproto.client.rollouts import read_rollouts
from sciproto.processes import ServerProcess, sciproto_command, start_server

AGENT = Path(__file__).resolve().parents[2] / "examples" / "openai_agent.py"


def test_an_external_agent_collects_graded_groups(tiny_policy: ServerProcess, tmp_path: Path) -> None:
    env = start_server(["serve", "env", "--env", "toy", "--port", "0"], timeout_s=180)
    try:
        out = tmp_path / "rollouts.jsonl"
        done = subprocess.run(sciproto_command(
            "agent-collect", "--env", env.target, "--policy", tiny_policy.target, "--task-env", "toy",
            "--tasks", "2", "--group-size", "2", "--out", str(out), "--timeout", "300", "--preload", "openai",
            "--command", f"{sys.executable} {AGENT}"), capture_output=True, text=True, timeout=600, check=False)
        assert done.returncode == 0, done.stderr
        summary = json.loads(done.stdout.strip().splitlines()[-1])
        assert summary["records"] == 4 and summary["scored"] == 4 and summary["infra_errors"] == 0
        records = list(read_rollouts(out))
        assert sorted(r.rollout_id for r in records) == ["toy/train/0/0", "toy/train/0/1", "toy/train/1/0",
                                                         "toy/train/1/1"]
        for record in records:
            assert record.status == "SCORED" and sum(record.loss_mask) > 0 and record.steps == 1
            assert record.messages[-1].role == "assistant" and record.messages[0].role == "user"

        failing = subprocess.run(sciproto_command(
            "agent-collect", "--env", env.target, "--policy", tiny_policy.target, "--task-env", "toy",
            "--tasks", "1", "--group-size", "1", "--out", str(tmp_path / "failed.jsonl"),
            "--command", f"{sys.executable} -c \"raise SystemExit('no model today')\""),
            capture_output=True, text=True, timeout=600, check=False)
        assert failing.returncode == 1 and "no run was scored" in failing.stderr
        [failed] = read_rollouts(tmp_path / "failed.jsonl")
        assert failed.status == "INFRA_ERROR" and "no model today" in failed.error

        # The same failing agent appending to `out`, which holds the 4 scored records above: the
        # summary and exit status are this run's, not the file's.
        again = subprocess.run(sciproto_command(
            "agent-collect", "--env", env.target, "--policy", tiny_policy.target, "--task-env", "toy",
            "--tasks", "1", "--group-size", "1", "--out", str(out),
            "--command", f"{sys.executable} -c \"raise SystemExit('no model today')\""),
            capture_output=True, text=True, timeout=600, check=False)
        assert again.returncode == 1 and "no run was scored" in again.stderr
        assert json.loads(again.stdout.strip().splitlines()[-1])["records"] == 1
        assert len(list(read_rollouts(out))) == 5

        # A module the agent's interpreter lacks: one line naming it, before any run.
        missing = subprocess.run(sciproto_command(
            "agent-collect", "--env", env.target, "--policy", tiny_policy.target, "--preload", "no_such_sdk",
            "--out", str(tmp_path / "missing.jsonl"), "--command", f"{sys.executable} {AGENT}"),
            capture_output=True, text=True, timeout=600, check=False)
        assert missing.returncode == 2 and "Traceback" not in missing.stderr, missing.stderr
        assert "import no_such_sdk failed: ModuleNotFoundError" in missing.stderr, missing.stderr
        assert not (tmp_path / "missing.jsonl").exists()
    finally:
        env.stop()
