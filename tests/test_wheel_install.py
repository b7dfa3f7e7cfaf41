"""The wheel, installed into a clean virtual environment, runs the demo from outside the source
tree: the configs are package data. The venv installs the wheel alone (--no-deps) and reads the
dependencies (torch, Aviary, ...) from the test interpreter's site-packages through a .pth file,
so nothing is downloaded or reinstalled."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP = shutil.ignore_patterns(".git", ".venv", "node_modules", "runs", "build", "dist", "*.egg-info",
                              "__pycache__", ".pytest_cache", ".hypothesis", ".test-artifacts", "tests", "bench")


def run(command: list[str], **options) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(command, capture_output=True, text=True, check=False, **options)
    assert result.returncode == 0, f"{command}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_wheel_in_a_clean_venv_runs_the_demo_from_elsewhere(tmp_path: Path) -> None:
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=SKIP, symlinks=True)
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
         str(tmp_path / "dist"), str(source)])
    wheel = next((tmp_path / "dist").glob("sciproto-*.whl"))

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    purelib = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (purelib / "shared-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], env=clean)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = run([str(python), "-c", "import sciproto.config as c; print(c.__file__); print(c.CONFIG_DIR)"],
                cwd=elsewhere, env=clean).stdout.split()
    assert all(Path(p).is_relative_to(purelib) for p in where), f"sciproto not from the wheel: {where}"

    # The demo's first step, as the README runs it, from a directory without configs/.
    result = subprocess.run(
        [str(venv / "bin" / "sciproto"), "train", "--config", "demo", "--set", "run.dir=runs",
         "--set", "budget.max_steps=1", "--set", "progress=false"],
        capture_output=True, text=True, timeout=600, check=False, cwd=elsewhere,
        env={**clean, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((elsewhere / "runs" / "demo" / "summary.json").read_text())
    assert [step["step"] for step in summary["steps"]] == [1]
