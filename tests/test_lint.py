"""The code passes the linter the project configures (`[tool.ruff]` in pyproject.toml): imports
sorted, none unused, no blind except without a reason. A failure lists each finding with its file
and line; `ruff check --fix .` fixes most."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing() -> None:
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (it is in the dev extra)")
    result = subprocess.run([ruff, "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


# The longest a function (or method) under clients/ or learner/ may be, in lines: a reader follows
# one in a sitting. A longer one is split into named parts (as `sciproto train`'s loop is into
# clients/train/producers.py and clients/train/events.py).
MAX_FUNCTION_LINES = 110


def long_functions(folders: tuple[str, ...] = ("clients", "learner"), limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """"path:line name (N lines)" of every function longer than `limit` lines, nested ones included."""
    import ast

    found = []
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                    if lines > limit:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_is_too_long_to_read() -> None:
    # In a fresh interpreter, as tests/test_layers.py parses: in a process where other tests ran,
    # Python 3.11.7's ast.parse has failed with "AST constructor recursion depth mismatch".
    run = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=120, check=True)
    found = json.loads(run.stdout)
    too_long = found["too_long"]
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines (split them into named parts):\n" + "\n".join(
        too_long)
    assert found["over_60"], "the check finds functions (of more than 60 lines today)"


if __name__ == "__main__":
    print(json.dumps({"too_long": long_functions(), "over_60": long_functions(limit=60)}))
