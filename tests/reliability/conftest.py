"""Fixtures of the reliability tests: the fuzzed servers and the tally of what the fuzz saw."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from reliability_servers import ARTIFACTS, ENV_ARGS, POLICY_ARGS, Tally, learner_args, start_all

from sciproto.processes import ServerProcess


@pytest.fixture(scope="module")
def fuzzed_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    """An env server (toy, gsm8k), a policy server (tiny) and a learner (tiny), all with a 4 MiB
    receive limit."""
    ARTIFACTS.mkdir(exist_ok=True)
    run_dir = tmp_path_factory.mktemp("fuzzed-learner") / "run"
    servers = start_all({"env": ENV_ARGS, "policy": POLICY_ARGS, "learner": learner_args(run_dir)})
    yield servers
    for server in servers.values():
        server.stop(grace_s=15)


@pytest.fixture(scope="module")
def tally() -> Iterator[Tally]:
    counts = Tally()
    yield counts
    ARTIFACTS.mkdir(exist_ok=True)
    report = json.dumps(counts.as_dict(), indent=2, sort_keys=True)
    (ARTIFACTS / "fuzz_counts.json").write_text(report + "\n")
    print(f"\nfuzz counts:\n{report}")
