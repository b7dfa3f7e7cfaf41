"""Every benchmark script starts: `python bench/X.py --help` exits 0. Python puts the script's own
folder, bench/, first on sys.path, so a bench script named like one of the project's top-level
packages (gateway, learner, clients, ...) hides that package from every other bench script that
imports it, however deep."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(path.name for path in (ROOT / "bench").glob("*.py"))
PACKAGES = sorted(path.parent.name for path in ROOT.glob("*/__init__.py"))


def test_no_bench_script_is_named_like_a_package() -> None:
    assert PACKAGES, "no top-level package found"
    clashes = [name for name in SCRIPTS if name.removesuffix(".py") in PACKAGES]
    assert not clashes, f"bench scripts named like a top-level package, which they hide from bench/: {clashes}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_bench_script_starts(script: str) -> None:
    done = subprocess.run([sys.executable, f"bench/{script}", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage" in done.stdout.lower(), done.stdout[-500:]
