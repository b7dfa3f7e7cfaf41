"""The Node.js client (clients/node) runs a full GSM8K episode against a real Python server."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from sciproto.processes import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "clients" / "node" / "gsm8k_episode.js"

pytestmark = pytest.mark.skipif(
    shutil.which("node") is None or not (ROOT / "node_modules" / "@grpc" / "grpc-js").is_dir(),
    reason="needs Node.js and `npm ci` (scripts/setup-venv.sh --full runs it)",
)


def test_node_client_runs_a_gsm8k_episode(env_server: ServerProcess) -> None:
    result = subprocess.run(["node", str(SCRIPT), env_server.target], capture_output=True, text=True,
                            timeout=60, cwd=ROOT, check=False)
    assert result.returncode == 0, result.stderr + result.stdout
    episode = json.loads(result.stdout)
    assert episode["reward"] == 1 and episode["reward_status"] == "REWARD_STATUS_SCORED"
    assert episode["tools"] == ["calculator", "submit_answer"]
    assert episode["calculator_result"] == "408" and episode["step_count"] == 2


def test_node_client_fails_on_an_unreachable_server() -> None:
    result = subprocess.run(["node", str(SCRIPT), "127.0.0.1:1"], capture_output=True, text=True,
                            timeout=60, cwd=ROOT, check=False)
    assert result.returncode == 1 and "Describe failed" in result.stderr
