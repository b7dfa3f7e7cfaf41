"""Servers the conformance kit is run against, each a separate process."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sciproto.processes import ServerProcess, sciproto_command, start_command, start_server

ROOT = Path(__file__).resolve().parents[2]
LOG_DIR = ROOT / ".test-artifacts"
NODE_SERVER = ROOT / "env_servers" / "node" / "server.js"


def has_node() -> bool:
    return shutil.which("node") is not None and (ROOT / "node_modules" / "@grpc" / "grpc-js").is_dir()


def run_kit(kind: str, target: str, *options: str, timeout_s: float = 240) -> tuple[int, dict]:
    """`sciproto conformance KIND TARGET --json`: its exit code and its report."""
    result = subprocess.run([*sciproto_command("conformance", kind, target, "--json", *options)],
                            capture_output=True, text=True, timeout=timeout_s, cwd=ROOT, check=False)
    try:
        report = json.loads(result.stdout)
    except json.JSONDecodeError:
        raise AssertionError(f"the kit printed no JSON report (exit {result.returncode}):\n"
                             f"{result.stdout}\n{result.stderr}") from None
    return result.returncode, report


def outcomes(report: dict) -> dict[str, str]:
    return {check["name"]: check["outcome"] for check in report["checks"]}


def serve(name: str, command: list[str]) -> Iterator[ServerProcess]:
    LOG_DIR.mkdir(exist_ok=True)
    server = start_command(command, timeout_s=120, log_file=LOG_DIR / f"conformance-{name}.log", cwd=ROOT)
    try:
        yield server
    finally:
        server.stop(grace_s=15)


@pytest.fixture(scope="module")
def python_env_server() -> Iterator[ServerProcess]:
    yield from serve("python-env", sciproto_command("serve", "env", "--env", "toy", "--port", "0",
                                                    "--set", "max_live_episodes=8",
                                                    "--set", "heartbeat_interval_s=0.2"))


@pytest.fixture(scope="module")
def node_env_server() -> Iterator[ServerProcess]:
    if not has_node():
        pytest.skip("needs Node.js and `npm ci` (scripts/setup-venv.sh --full runs it)")
    yield from serve("node-env", ["node", str(NODE_SERVER), "--port", "0", "--max-live-episodes", "8"])


# A vLLM server on this CPU: eager (no compilation at start-up) with a small KV cache.
VLLM_CPU_FLAGS = ["--backend", "vllm", "--set", "vllm.enforce_eager=true", "--set", "vllm.kv_cache_bytes=134217728",
                  "--set", "vllm.max_model_len=2048"]


@pytest.fixture(scope="module", params=["transformers", "vllm"])
def policy_server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    LOG_DIR.mkdir(exist_ok=True)
    backend = VLLM_CPU_FLAGS if request.param == "vllm" else []
    server = start_server(["serve", "policy", "--model", "tiny", "--port", "0", "--set", "default_max_tokens=8",
                           *backend], timeout_s=300, log_file=LOG_DIR / f"conformance-policy-{request.param}.log")
    try:
        yield server
    finally:
        server.stop(grace_s=15)


FAULTS = ("wrong_status", "double_step", "leaky_session")


@pytest.fixture(scope="module")
def broken_env_servers() -> Iterator[dict[str, ServerProcess]]:
    """One env server per deliberate fault (tests/conformance/broken_env_server.py), started at once."""
    LOG_DIR.mkdir(exist_ok=True)

    def start(fault: str) -> ServerProcess:
        return start_command([sys.executable, "-m", "tests.conformance.broken_env_server", fault], timeout_s=120,
                             log_file=LOG_DIR / f"conformance-broken-{fault}.log", cwd=ROOT)

    with ThreadPoolExecutor(len(FAULTS)) as pool:
        futures = {fault: pool.submit(start, fault) for fault in FAULTS}
    servers = {fault: future.result() for fault, future in futures.items() if future.exception() is None}
    try:
        failed = [fault for fault, future in futures.items() if future.exception() is not None]
        if failed:
            raise futures[failed[0]].exception()  # type: ignore[misc]
        yield servers
    finally:
        for server in servers.values():
            server.stop(grace_s=15)
