"""`sciproto serve gateway` failing to start: one line saying what to fix, a non-zero exit; and its
help, whole at 80 columns."""

from __future__ import annotations

import os
import subprocess

from sciproto.processes import ServerProcess, sciproto_command
from tests.gateway.conftest import serve_gateway


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(sciproto_command("serve", "gateway", *args), capture_output=True, text=True, timeout=120,
                          check=False)


def test_an_unreachable_policy_server_is_named() -> None:
    failed = _run("--policy", "127.0.0.1:1", "--port", "0")
    assert failed.returncode == 2 and "Traceback" not in failed.stderr
    assert "the policy server at 127.0.0.1:1 did not answer Describe" in failed.stderr


def test_a_port_in_use_is_named(tiny_policy: ServerProcess) -> None:
    first = serve_gateway("--policy", tiny_policy.target)
    try:
        failed = _run("--policy", tiny_policy.target, "--port", str(first.port))
        assert failed.returncode == 2 and "Traceback" not in failed.stderr
        assert f"cannot listen on 127.0.0.1:{first.port}" in failed.stderr
        assert first.alive()
    finally:
        first.stop()


def test_the_help_names_every_option_in_full_at_80_columns() -> None:
    shown = subprocess.run(sciproto_command("serve", "gateway", "--help"), capture_output=True, text=True, timeout=120,
                           check=False, env={**os.environ, "COLUMNS": "80", "TERMINAL_WIDTH": "80"})
    assert shown.returncode == 0, shown.stderr
    assert "…" not in shown.stdout
    for option in ("--policy-token-file", "--max-session-tokens", "--max-held-records", "--max-request-bytes",
                   "--model-name", "--verbose"):
        assert option in shown.stdout, option
