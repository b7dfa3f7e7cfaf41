"""The conformance kit, run as `sciproto conformance ... --json` against real server processes:
the Python env and policy servers pass it; servers with one deliberate violation each fail the
check that looks at it, and only that check; the exit code says so."""

from __future__ import annotations

import subprocess

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from sciproto.processes import ServerProcess, sciproto_command
from tests.conformance.conftest import FAULTS, ROOT, outcomes, run_kit


def test_python_env_server_passes_every_check(python_env_server: ServerProcess) -> None:
    code, report = run_kit("env", python_env_server.target)
    assert code == 0, report["summary"] + "\n" + "\n".join(
        f"{c['name']}: {c['detail']}" for c in report["checks"] if c["outcome"] != "PASS")
    assert set(outcomes(report).values()) == {"PASS"}  # nothing skipped: max_live_episodes=8 is filled
    assert len(report["checks"]) >= 20 and report["ok"] is True


def test_python_policy_server_passes_every_check(policy_server: ServerProcess) -> None:
    code, report = run_kit("policy", policy_server.target)
    assert code == 0, report["summary"] + "\n" + "\n".join(
        f"{c['name']}: {c['detail']}" for c in report["checks"] if c["outcome"] != "PASS")
    assert set(outcomes(report).values()) == {"PASS"}


def test_text_report_has_one_line_per_check_and_a_summary(python_env_server: ServerProcess) -> None:
    result = subprocess.run(sciproto_command("conformance", "env", python_env_server.target, "--only", "health"),
                            capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
    lines = result.stdout.strip().splitlines()
    assert result.returncode == 0, result.stdout + result.stderr
    assert [line.split()[:2] for line in lines[:-1]] == [["PASS", "describe"], ["PASS", "health"]]
    assert lines[-1].endswith("conforms: 2 passed, 0 failed, 0 skipped")


def test_unreachable_server_fails_with_exit_code_1() -> None:
    code, report = run_kit("env", "127.0.0.1:1", "--timeout", "3", timeout_s=60)
    assert code == 1 and report["ok"] is False
    assert outcomes(report)["describe"] == "FAIL" and "UNAVAILABLE" in report["checks"][0]["detail"]


@pytest.fixture(params=FAULTS)
def broken(request: pytest.FixtureRequest, broken_env_servers: dict[str, ServerProcess]) -> tuple[str, ServerProcess]:
    return request.param, broken_env_servers[request.param]


CAUGHT_BY = {
    "wrong_status": ({"unknown_environment"}, "expected NOT_FOUND/UNKNOWN_ENVIRONMENT, got INVALID_ARGUMENT"),
    "double_step": ({"step_retry_is_idempotent"}, "Step"),
    "leaky_session": ({"session_multiplexing", "session_closes_episodes_on_end",
                       "session_closes_episodes_on_cancel"}, "still open"),
}


def test_each_broken_server_is_caught(broken: tuple[str, ServerProcess]) -> None:
    fault, server = broken
    code, report = run_kit("env", server.target, "--only", "unknown_environment", "--only", "step_retry_is_idempotent",
                           "--only", "session_multiplexing", "--only", "session_closes_episodes_on_end",
                           "--only", "session_closes_episodes_on_cancel", "--only", "episode_lifecycle",
                           # The leaky server never closes them: 2 s tells, 3 times over. A server
                           # that closes them gets the kit's room of a loaded machine (2 s was seen
                           # to run out once in a whole test run, and costs nothing when it closes).
                           "--close-wait", "2" if fault == "leaky_session" else "15")
    failed = {name for name, outcome in outcomes(report).items() if outcome == "FAIL"}
    expected, says = CAUGHT_BY[fault]
    assert code == 1 and not report["ok"]
    assert failed == expected, report
    details = " ".join(check["detail"] for check in report["checks"] if check["name"] in failed)
    assert says in details, details


def test_node_env_server_passes_every_check(node_env_server: ServerProcess) -> None:
    code, report = run_kit("env", node_env_server.target)
    assert code == 0, report["summary"] + "\n" + "\n".join(
        f"{c['name']}: {c['detail']}" for c in report["checks"] if c["outcome"] != "PASS")
    assert set(outcomes(report).values()) == {"PASS"}
    assert "digits:train" in report["checks"][0]["detail"]


def test_node_env_server_reflection_serves_the_contract(node_env_server: ServerProcess) -> None:
    """What grpcurl does: find the service through reflection and read its methods."""
    with grpc.insecure_channel(node_env_server.target) as channel:
        pool = DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
        service = pool.FindServiceByName("sciproto.v1.EnvironmentService")
        methods = {method.name for method in service.methods}
        reset = pool.FindMessageTypeByName("sciproto.v1.ResetRequest")
    assert methods == {"Describe", "Reset", "Step", "Verify", "Close", "Session", "Fork", "Reference"}
    assert "task_ref" in reset.fields_by_name
