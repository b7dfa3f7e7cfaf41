"""`sciproto conformance env --semantic` against real env servers: the shipped environments (gsm8k
on every split, toy, notebook, and the Node.js `digits` server) mean what they declare, and a
server whose grader rewards an empty reply is caught."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from sciproto.processes import ServerProcess, sciproto_command, start_command
from tests.conformance.conftest import LOG_DIR, ROOT, outcomes, run_kit, serve
from tests.conftest import NOTEBOOK_SANDBOX

SEMANTIC = ("reward_range_declared", "reference_reaches_max", "do_nothing_gets_baseline", "garbage_gets_baseline",
            "same_seed_same_episode", "rewards_in_range", "verify_stored_agrees")


def run_semantic(target: str, env: str, *options: str) -> tuple[int, dict]:
    return run_kit("env", target, "--env", env, "--semantic", "--only", "semantic", *options, timeout_s=600)


def assert_all_pass(code: int, report: dict) -> None:
    assert set(outcomes(report)) == {"describe", *SEMANTIC}, report
    assert code == 0 and report["ok"], report
    assert set(outcomes(report).values()) == {"PASS"}, report


@pytest.fixture(scope="module")
def gsm8k_server() -> Iterator[ServerProcess]:
    yield from serve("semantic-gsm8k", sciproto_command("serve", "env", "--env", "gsm8k", "--port", "0"))


@pytest.fixture(scope="module")
def notebook_server() -> Iterator[ServerProcess]:
    yield from serve("semantic-notebook", sciproto_command(
        "serve", "env", "--env", "notebook", "--port", "0", "--set", f"env_options.notebook.sandbox={NOTEBOOK_SANDBOX}"))


def test_gsm8k_means_what_it_declares_on_every_split(gsm8k_server: ServerProcess) -> None:
    code, report = run_semantic(gsm8k_server.target, "gsm8k")
    assert_all_pass(code, report)
    details = {check["name"]: check["detail"] for check in report["checks"]}
    for split in ("train", "test", "short_train", "short_test", "short_text_train", "short_text_test"):
        assert split in details["reference_reaches_max"]
    assert "min -1, baseline 0, max 1" in details["reward_range_declared"]


def test_toy_means_what_it_declares(python_env_server: ServerProcess) -> None:
    assert_all_pass(*run_semantic(python_env_server.target, "toy"))


def test_notebook_means_what_it_declares(notebook_server: ServerProcess) -> None:
    assert_all_pass(*run_semantic(notebook_server.target, "notebook", "--tasks-per-split", "1", "--timeout", "240"))


def test_node_digits_server_means_what_it_declares(node_env_server: ServerProcess) -> None:
    assert_all_pass(*run_semantic(node_env_server.target, "digits"))


@pytest.fixture(scope="module")
def generous_server() -> Iterator[ServerProcess]:
    LOG_DIR.mkdir(exist_ok=True)
    server = start_command([sys.executable, "-m", "tests.conformance.broken_env_server", "generous_grader"],
                           timeout_s=120, log_file=LOG_DIR / "conformance-broken-generous_grader.log", cwd=ROOT)
    try:
        yield server
    finally:
        server.stop(grace_s=15)


def test_a_grader_that_rewards_an_empty_reply_is_caught(generous_server: ServerProcess) -> None:
    code, report = run_semantic(generous_server.target, "toy")
    failed = {name for name, outcome in outcomes(report).items() if outcome == "FAIL"}
    assert code == 1 and not report["ok"]
    assert failed == {"do_nothing_gets_baseline", "garbage_gets_baseline"}, report
    details = " ".join(check["detail"] for check in report["checks"] if check["name"] in failed)
    assert "above the baseline 0" in details, details
