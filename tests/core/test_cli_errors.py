"""What a user sees when a command fails: one or two lines saying what is wrong and what to
do, a non-zero exit, the traceback only with --debug. Real server processes throughout."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from sciproto.processes import ServerProcess, sciproto_command, start_server

ENV = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}


def sciproto(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(sciproto_command(*args), capture_output=True, text=True, timeout=timeout,
                          check=False, env=ENV)


def assert_short_error(result: subprocess.CompletedProcess[str], *expected: str) -> None:
    """Non-zero exit, no traceback, at most two lines on stderr holding every expected text."""
    assert result.returncode != 0, result.stderr
    assert "Traceback" not in result.stderr + result.stdout, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert 1 <= len(lines) <= 2, result.stderr[-2000:]
    for text in expected:
        assert text in result.stderr, result.stderr


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def toy_env() -> ServerProcess:
    server = start_server(["serve", "env", "--env", "toy", "--port", "0"], timeout_s=120)
    yield server
    server.stop()


def test_port_in_use(toy_env: ServerProcess) -> None:
    result = sciproto("serve", "env", "--env", "toy", "--port", str(toy_env.port))
    assert_short_error(result, f"127.0.0.1:{toy_env.port}", "in use", "--port")
    debug = sciproto("serve", "env", "--env", "toy", "--port", str(toy_env.port), "--debug")
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_collect_against_servers_that_are_not_running(tmp_path: Path, toy_env: ServerProcess) -> None:
    nowhere = f"127.0.0.1:{free_port()}"
    result = sciproto("collect", "--env", nowhere, "--policy", nowhere, "--tasks", "toy:train",
                      "--output", str(tmp_path / "out.jsonl"))
    assert_short_error(result, "env server", nowhere, "is it running")
    # The env server runs, the policy server does not: said at once, without SHUTTING_DOWN.
    result = sciproto("collect", "--env", toy_env.target, "--policy", nowhere, "--tasks", "toy:train",
                      "--limit", "2", "--output", str(tmp_path / "out.jsonl"))
    assert_short_error(result, "policy server", nowhere, "is it running")
    assert "SHUTTING_DOWN" not in result.stderr


@pytest.mark.parametrize(("tasks", "expected"), [("toy:nosplit", "no split 'nosplit'"),
                                                 ("nope:train", "does not host 'nope'")])
def test_collect_unknown_split_or_env(tmp_path: Path, toy_env: ServerProcess, tasks: str, expected: str) -> None:
    result = sciproto("collect", "--env", toy_env.target, "--policy", toy_env.target, "--tasks", tasks,
                      "--output", str(tmp_path / "out.jsonl"))
    assert_short_error(result, expected)


def test_train_with_an_unknown_env_says_so_before_starting_anything(tmp_path: Path) -> None:
    result = sciproto("train", "--set", f"run.dir={tmp_path}", "--set", "env.envs=[nope]",
                      "--set", "rollout.tasks=nope:train")
    assert_short_error(result, "unknown environment 'nope'", "toy")
    assert not list(tmp_path.iterdir()), "no run directory for a run that cannot start"


def test_serve_env_names_only_importable_envs_and_how_to_install_the_others() -> None:
    result = sciproto("serve", "env", "--env", "hotpotqa")
    assert_short_error(result, "pip install aviary.hotpotqa")
    unknown = sciproto("serve", "env", "--env", "nope")
    assert_short_error(unknown, "unknown environment 'nope'")
    listed = unknown.stderr.split("other names Aviary can build:")[1]
    assert "calculator" in listed and "hotpotqa" not in listed


def test_serve_reads_the_port_from_its_config_file_unless_a_flag_says_otherwise(tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "env.yaml"
    config.write_text(f"server:\n  port: {port}\nenvs: [toy]\n")
    from_file = start_server(["serve", "env", "--config", str(config)], timeout_s=120)
    try:
        assert from_file.port == port
    finally:
        from_file.stop()
    flag = start_server(["serve", "env", "--config", str(config), "--port", "0"], timeout_s=120)
    try:
        assert flag.port != port
    finally:
        flag.stop()


def test_serve_env_takes_its_section_prefix_in_set() -> None:
    server = start_server(["serve", "env", "--port", "0", "--set", "env.envs=[toy,gsm8k]"], timeout_s=120)
    try:
        assert any("hosting toy, gsm8k" in line for line in server.output)
    finally:
        server.stop()
