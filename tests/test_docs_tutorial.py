"""The tutorial (docs/tutorial.md) runs as written: its commands, in order, from the repository
root (serve the tutorial's environment, check it with the conformance kit, train, evaluate the
checkpoint) and its Python snippet that reads the rollouts. For CI speed the run trains 2 steps
instead of 12, and the evaluation takes 4 tasks."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from sciproto.processes import sciproto_command, start_server

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs/tutorial.md").read_text()
BASH = [line for block in re.findall(r"```bash\n(.*?)```", PAGE, re.DOTALL)
        for line in (re.sub(r"\s+#.*$", "", raw).strip() for raw in block.splitlines()) if line]
PYTHON = re.findall(r"```python\n(.*?)```", PAGE, re.DOTALL)


def command(prefix: str) -> list[str]:
    found = [line for line in BASH if line.startswith(prefix)]
    assert len(found) == 1, f"the tutorial has {len(found)} commands starting {prefix!r}"
    return shlex.split(found[0])


def run(argv: list[str], tmp_path: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(sciproto_command(*argv[1:]), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, check=False,
                          env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    (tmp_path / f"{argv[1]}.out").write_text(done.stdout + done.stderr)
    return done


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_tutorial_runs_as_written(tmp_path: Path) -> None:
    serve = command("sciproto serve env")
    server = start_server([*serve[1:], "--port", "0"], timeout_s=180, cwd=ROOT)
    try:
        conformance = [word.replace("127.0.0.1:50051", server.target)
                       for word in command("sciproto conformance env")]
        checked = run(conformance, tmp_path, 300)
        assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-2000:]
        assert "conforms" in checked.stdout and "reference_reaches_max" in checked.stdout
        # The output the page shows is the kit's own, and the lines it leaves out are as many as it says.
        shown, left_out = re.search(r"sciproto conformance env.*?```text\n(.*?)```\n\n\((\d+) more `PASS` lines",
                                    PAGE, re.DOTALL).groups()
        real = checked.stdout.replace(server.target, "127.0.0.1:50051").splitlines()
        assert [line for line in shown.splitlines() if line not in real] == [], checked.stdout
        assert sum(line.startswith("PASS") for line in real) - shown.count("PASS ") == int(left_out), checked.stdout

        runs = tmp_path / "runs"
        train = [*command("sciproto train"), "--set", f"run.dir={runs}", "--set", "budget.max_steps=2",
                 "--set", "progress=false"]
        trained = run(train, tmp_path, 420)
        assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
        assert (runs / "letters/checkpoints").is_dir() and "max_steps" in trained.stdout

        evaluate = [word.replace("127.0.0.1:50051", server.target).replace("runs/letters", str(runs / "letters"))
                    for word in command("sciproto eval")]
        evaluated = run([*evaluate, "--limit", "4", "--output", str(tmp_path / "eval.json")], tmp_path, 300)
        assert evaluated.returncode == 0, evaluated.stdout[-3000:] + evaluated.stderr[-3000:]
        assert "letters:test, 4 tasks" in evaluated.stdout and (tmp_path / "eval.json").is_file()
    finally:
        server.stop()

    reader = next(snippet for snippet in PYTHON if "read_rollouts" in snippet)
    shown = subprocess.run([sys.executable, "-c", reader], cwd=tmp_path, capture_output=True, text=True,
                           timeout=120, check=False)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert re.search(r"^\d+ rollouts$", shown.stdout, re.MULTILINE) and "policy version 0:" in shown.stdout
