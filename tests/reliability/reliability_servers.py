"""Server processes for the reliability tests, started together to save wall time, and the
tally of the requests the fuzz tests sent and the statuses they saw."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sciproto.processes import ServerProcess, start_server

ARTIFACTS = Path(__file__).resolve().parents[2] / ".test-artifacts"

# Receive limit of the fuzzed servers, small so that going past it is cheap.
RECEIVE_LIMIT_BYTES = 4 * 1024 * 1024

ENV_ARGS = ["serve", "env", "--env", "toy", "--env", "gsm8k", "--port", "0",
            "--set", f"server.max_receive_message_bytes={RECEIVE_LIMIT_BYTES}", "--set", "max_live_episodes=64"]
POLICY_ARGS = ["serve", "policy", "--model", "tiny", "--port", "0",
               "--set", f"server.max_receive_message_bytes={RECEIVE_LIMIT_BYTES}", "--set", "default_max_tokens=8",
               "--set", "weights.chunk_timeout_s=5"]


def learner_args(run_dir: Path) -> list[str]:
    return ["serve", "learner", "--port", "0", "--set", f"run_dir={run_dir}",
            "--set", f"server.max_receive_message_bytes={RECEIVE_LIMIT_BYTES}",
            "--set", "batch_groups=2", "--set", "buffer_capacity=4", "--set", "add_timeout_s=0.5"]


def start_all(commands: dict[str, list[str]]) -> dict[str, ServerProcess]:
    """Start several servers at once; if one fails, stop the others and raise."""
    for name in commands:
        (ARTIFACTS / f"reliability-{name}.log").unlink(missing_ok=True)
    with ThreadPoolExecutor(len(commands)) as pool:
        futures = {name: pool.submit(start_server, args, timeout_s=180, log_file=ARTIFACTS / f"reliability-{name}.log")
                   for name, args in commands.items()}
        started, failure = {}, None
        for name, future in futures.items():
            try:
                started[name] = future.result()
            except Exception as error:  # noqa: BLE001 - stop the rest, then raise the first
                failure = failure or error
    if failure is not None:
        for server in started.values():
            server.stop(grace_s=5)
        raise failure
    return started


def health_status(target: str, timeout_s: float = 10.0) -> int:
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s).status


class Tally:
    """Requests sent and statuses seen, per service, written to .test-artifacts/fuzz_counts.json."""

    def __init__(self) -> None:
        self.requests: Counter[str] = Counter()
        self.statuses: dict[str, Counter[str]] = {}

    def saw(self, service: str, status: str, requests: int = 1) -> None:
        self.requests[service] += requests
        self.statuses.setdefault(service, Counter())[status] += 1

    def as_dict(self) -> dict[str, object]:
        return {
            "requests_sent": dict(self.requests), "requests_total": sum(self.requests.values()),
            "statuses": {service: dict(counts) for service, counts in self.statuses.items()},
        }
