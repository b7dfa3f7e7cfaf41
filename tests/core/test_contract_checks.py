"""The contract checks run by CI can fail: each test plants one violation in a
copy of the repository's contracts and expects scripts/check-contracts.sh to
reject it (and the untouched copy to pass)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "scripts" / "check-contracts.sh"
COMMON = Path("proto/sciproto/v1/common.proto")
FIELD_COMMENT = "  // Human-readable note: why unscored, what failed.\n"
FIELD = "  string detail = 4;\n"


@pytest.fixture()
def copy(tmp_path: Path) -> Path:
    for part in ("proto", "scripts", "sciproto/_proto"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def run_checks(root: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable}
    return subprocess.run(["bash", str(CHECK), str(root)], check=False, capture_output=True, text=True, timeout=180, env=env)


def edit(root: Path, old: str, new: str) -> None:
    path = root / COMMON
    text = path.read_text()
    assert old in text, f"{old!r} not in {COMMON}: update this test with the contract"
    path.write_text(text.replace(old, new, 1))


def test_untouched_copy_passes(copy: Path) -> None:
    result = run_checks(copy)
    assert result.returncode == 0, result.stdout + result.stderr


def test_lint_rejects_enum_without_unspecified_zero(copy: Path) -> None:
    (copy / COMMON).write_text((copy / COMMON).read_text() + "\n// Colour.\nenum Colour {\n  // Red.\n  RED = 0;\n}\n")
    result = run_checks(copy)
    assert result.returncode != 0
    assert "_UNSPECIFIED" in result.stdout and "buf breaking" not in result.stdout


def test_breaking_rejects_deleted_field(copy: Path) -> None:
    edit(copy, FIELD_COMMENT + FIELD, "")
    result = run_checks(copy)
    assert result.returncode != 0
    assert "buf breaking" in result.stdout and "detail" in result.stdout + result.stderr


def test_codegen_check_rejects_stale_generated_code(copy: Path) -> None:
    edit(copy, FIELD, FIELD + "  // Seconds the grader took.\n  double grading_seconds = 99;\n")
    result = run_checks(copy)
    assert result.returncode != 0
    assert "generated code" in result.stdout and "differs from the contracts" in result.stdout
