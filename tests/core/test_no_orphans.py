"""No child of `sciproto train` outlives it, however it dies: SIGKILL (nothing of train runs
after it) at several moments of start-up and mid-run, then every process that inherited the
run's marker must be gone."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from sciproto.processes import sciproto_command

MARKER = "SCIPROTO_TEST_MARKER"
GONE_WITHIN_S = 90.0  # the lifeline grace (SIGTERM, then SIGKILL after 30 s) and a loaded machine


def marked(token: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(MARKER) == token:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.05)


def has_children(process: subprocess.Popen[bytes]) -> bool:
    try:
        return bool(psutil.Process(process.pid).children())
    except psutil.NoSuchProcess:
        return False


def ready_in(path: Path) -> bool:
    return path.is_file() and "SCIPROTO_READY" in path.read_text(errors="replace")


def lines_in(path: Path) -> bool:
    return path.is_file() and bool(path.read_text().strip())


MOMENTS: dict[str, Callable[[subprocess.Popen[bytes], Path], bool]] = {
    # the first child exists: it is still importing, before it could listen
    "first-child-started": lambda process, run: has_children(process),
    # the env server listens, the policy server is still loading its model, no learner yet
    "env-listening": lambda process, run: ready_in(run / "env.log"),
    # every server runs and the learner has made a step
    "mid-run": lambda process, run: lines_in(run / "metrics.jsonl"),
}


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("moment", list(MOMENTS))
def test_sigkilled_train_leaves_no_child_behind(tmp_path: Path, moment: str) -> None:
    token = uuid.uuid4().hex
    command = sciproto_command("train", "--config", "demo", "--set", f"run.dir={tmp_path}",
                               "--set", "run.name=k", "--set", "progress=false",
                               "--set", "budget.max_seconds=300", "--set", "budget.target_reward=null")
    train = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env={**os.environ, MARKER: token, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    try:
        wait_for(lambda: MOMENTS[moment](train, tmp_path / "k"), 240, moment)
        children = [p for p in marked(token) if p.pid != train.pid]
        assert children, "the moment should find children running"
        train.send_signal(signal.SIGKILL)
        train.wait(timeout=10)
        wait_for(lambda: not marked(token), GONE_WITHIN_S,
                 "the children of a SIGKILLed train to exit")
    finally:
        if train.poll() is None:
            train.kill()
        for leftover in marked(token):  # never leave a server running for the next test
            leftover.kill()
