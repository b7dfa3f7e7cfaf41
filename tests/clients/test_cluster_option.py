"""`sciproto train --cluster`: a word on what to install when Ray is missing, and on a bad value;
one or two lines and a non-zero exit, before any server starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# The CLI in a Python that cannot import Ray (as where the sciproto[ray] extra is not installed).
WITHOUT_RAY = "import sys; sys.modules['ray'] = None; from sciproto.cli import main; main(sys.argv[1:])"


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", WITHOUT_RAY, "train", "--set", f"run.dir={tmp_path}", *args],
                          capture_output=True, text=True, timeout=120)


def test_cluster_ray_without_ray_says_what_to_install(tmp_path: Path) -> None:
    result = run(tmp_path, "--cluster", "ray")
    assert result.returncode != 0
    assert "pip install 'sciproto[ray]'" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not list(tmp_path.glob("*/*.log"))  # no server started


def test_an_unknown_cluster_is_refused(tmp_path: Path) -> None:
    result = run(tmp_path, "--cluster", "slurm")
    assert result.returncode == 2
    assert "--cluster 'slurm': use local or ray" in result.stderr, result.stderr
