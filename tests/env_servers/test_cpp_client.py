"""The C++ client (clients/cpp), built from proto/ with CMake, runs a full GSM8K episode against a
real Python server."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from sciproto.client.env import EnvClient
from sciproto.processes import ServerProcess
from tests.env_servers.conftest import LOG_DIR, serve_env

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIR = ROOT / "clients" / "cpp"
BUILD_DIR = SOURCE_DIR / "build"
BINARY = BUILD_DIR / "gsm8k_episode"
# A first build compiles five generated and two hand-written files; later ones only what changed.
BUILD_TIMEOUT_S = 600


def has_toolchain() -> bool:
    tools = ("cmake", "c++", "protoc", "grpc_cpp_plugin", "pkg-config")
    if any(shutil.which(tool) is None for tool in tools):
        return False
    return subprocess.run(["pkg-config", "--exists", "grpc++", "protobuf"], check=False).returncode == 0


pytestmark = pytest.mark.skipif(
    not has_toolchain(),
    reason="needs cmake, a C++ compiler, protoc, grpc_cpp_plugin and grpc++ (scripts/test.sh installs"
           " Debian's libgrpc++-dev, protobuf-compiler-grpc, protobuf-compiler and libprotobuf-dev)",
)


def run_logged(args: list[str], log: Path) -> None:
    """Run a build step, its output going to `log`; fail with the log's tail if it fails."""
    with log.open("a") as output:
        result = subprocess.run(args, stdout=output, stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT_S,
                                cwd=ROOT, check=False)
    if result.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-40:])
        pytest.fail(f"{' '.join(args)} failed (exit {result.returncode}); see {log}:\n{tail}")


@pytest.fixture(scope="module")
def episode_binary() -> Path:
    """The built client. Configured once per build folder; the build itself recompiles only what
    changed since the last one (nothing, when the sources and proto/ are unchanged)."""
    LOG_DIR.mkdir(exist_ok=True)
    log = LOG_DIR / "cpp-client-build.log"
    log.write_text("")
    if not (BUILD_DIR / "CMakeCache.txt").is_file():
        run_logged(["cmake", "-S", str(SOURCE_DIR), "-B", str(BUILD_DIR)], log)
    run_logged(["cmake", "--build", str(BUILD_DIR), "--parallel", "2"], log)
    return BINARY


@pytest.fixture(scope="module")
def gsm8k_server() -> Iterator[ServerProcess]:
    """A server of its own, so that its episode counters are those of the C++ client alone."""
    yield from serve_env("cpp", "envs=[gsm8k]")


def run_client(binary: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          check=False)


async def test_cpp_client_runs_a_gsm8k_episode(episode_binary: Path, gsm8k_server: ServerProcess) -> None:
    result = run_client(episode_binary, gsm8k_server.target)
    assert result.returncode == 0, result.stderr + result.stdout
    episode = json.loads(result.stdout)
    assert episode["reward"] == 1 and episode["reward_status"] == "REWARD_STATUS_SCORED"
    assert episode["step_reward"] == 1 and episode["terminated"] is True
    assert episode["tools"] == ["calculator", "submit_answer"]
    assert episode["calculator_result"] == "408" and episode["step_count"] == 2
    assert episode["protocol_version"].split(".")[0] == "1"
    assert episode["closed"] is True
    assert episode["live_episodes_before"] == 0 and episode["live_episodes_after"] == 0
    # The server's own count agrees: one episode opened, by this client, and none left open.
    async with EnvClient(gsm8k_server.target) as client:
        counters = (await client.describe()).counters
    assert counters.episodes_opened == 1 and counters.live_episodes == 0


def test_cpp_client_fails_on_an_unreachable_server(episode_binary: Path) -> None:
    result = run_client(episode_binary, "127.0.0.1:1")
    assert result.returncode == 1 and "Describe failed: UNAVAILABLE" in result.stderr


def test_cpp_client_rejects_a_missing_target(episode_binary: Path) -> None:
    result = run_client(episode_binary)
    assert result.returncode == 2 and "usage:" in result.stderr
