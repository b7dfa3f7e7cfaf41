"""Every group a client sends is accounted exactly once, on real learner and policy processes:
step results name the groups they consumed and dropped, to the stream that sent them only; a
failed step gives its groups back; policy servers that fall behind are brought up to date."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_learner_service import (
    BATCH_GROUPS,
    TrainStream,
    describe,
    learner_config,
    make_group,
    serving_version,
    start_learner,
)

from sciproto.channel import make_channel
from sciproto.processes import ServerProcess, sciproto_command, start_server

BOUND_S = 60.0  # longest a lagging policy server may wait for the learner's weights


@pytest.fixture(scope="module")
def policy() -> Iterator[ServerProcess]:
    server = start_server(["serve", "policy", "--model", "tiny", "--port", "0"])
    yield server
    server.stop()


@pytest.fixture
def own_policy() -> Iterator[ServerProcess]:
    """A policy server this test alone uses (it gets killed)."""
    server = start_server(["serve", "policy", "--model", "tiny", "--port", "0"])
    yield server
    server.stop()


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


async def train_one_step(stream: TrainStream, prefix: str, version: int):
    for number in range(BATCH_GROUPS):
        await stream.send(make_group(f"{prefix}/{number}", version, seed=number))
    receipts = await stream.receipts(BATCH_GROUPS)
    assert all(r.accepted for r in receipts), receipts
    return await stream.next("step")


async def test_a_group_refused_stale_on_arrival_is_not_counted_again_by_the_next_step(
    policy: ServerProcess, run_dir: Path
) -> None:
    learner = start_learner(learner_config(run_dir, policy))
    try:
        async with make_channel(learner.target) as channel:
            stream = TrainStream(channel)
            version = (await describe(channel)).policy_version
            first = await train_one_step(stream, "fresh", version)
            await stream.send(make_group("late/0", first.policy_version - 1))  # K = 0: stale
            (receipt,) = await stream.receipts(1)
            assert (receipt.accepted, receipt.reason) == (False, "stale")
            second = await train_one_step(stream, "next", first.policy_version)
            await stream.close()
        # The receipt already told the client; the step must not report the group again.
        assert second.metrics["groups_dropped_stale"] == 0
        assert list(second.dropped_stale_group_ids) == []
        assert sorted(second.consumed_group_ids) == ["next/0", "next/1"]
        assert second.metrics["groups_refused_stale"] == 1
    finally:
        learner.stop()


async def test_each_stream_sees_only_its_own_groups_in_a_step_result(
    policy: ServerProcess, run_dir: Path
) -> None:
    learner = start_learner(learner_config(run_dir, policy))
    try:
        async with make_channel(learner.target) as channel:
            version = (await describe(channel)).policy_version
            a, b = TrainStream(channel), TrainStream(channel)
            await a.send(make_group("a/0", version, seed=1))
            assert (await a.receipts(1))[0].accepted
            await b.send(make_group("b/0", version, seed=2))
            assert (await b.receipts(1))[0].accepted
            step_a, step_b = await a.next("step"), await b.next("step")
            await a.close()
            await b.close()
        assert step_a.step == step_b.step and step_a.groups == step_b.groups == BATCH_GROUPS
        assert list(step_a.consumed_group_ids) == ["a/0"]
        assert list(step_b.consumed_group_ids) == ["b/0"]
    finally:
        learner.stop()


async def test_a_failed_step_gives_its_groups_back_and_they_train_next(
    policy: ServerProcess, run_dir: Path
) -> None:
    learner = start_learner(
        learner_config(run_dir, policy, faults={"fail_step_attempts": [1]})
    )
    try:
        async with make_channel(learner.target) as channel:
            version = (await describe(channel)).policy_version
            stream = TrainStream(channel)
            for number in range(BATCH_GROUPS):
                await stream.send(make_group(f"retry/{number}", version, seed=number))
            await stream.receipts(BATCH_GROUPS)
            failure = await stream.next("step_failure")
            step = await stream.next("step")
            await stream.close()
        assert "injected" in failure.error.message
        assert sorted(failure.returned_group_ids) == ["retry/0", "retry/1"]
        assert sorted(step.consumed_group_ids) == ["retry/0", "retry/1"]
        assert step.step == 1
    finally:
        learner.stop()


def test_push_every_beyond_max_staleness_plus_one_is_refused_at_start(
    policy: ServerProcess, run_dir: Path
) -> None:
    config = learner_config(run_dir, policy, push_every=3)  # max_staleness 0
    done = subprocess.run(
        sciproto_command("serve", "learner", "--config", str(config), "--port", "0"),
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode != 0
    message = done.stdout + done.stderr
    assert "push_every (3)" in message and "max_staleness + 1 (1)" in message, message[-2000:]
    assert "stale" in message


async def test_a_restarted_policy_server_gets_the_latest_weights_and_a_failed_push_is_retried(
    own_policy: ServerProcess, run_dir: Path
) -> None:
    policy = own_policy
    learner = start_learner(learner_config(run_dir, policy))
    port = policy.port
    try:
        async with make_channel(learner.target) as channel:
            stream = TrainStream(channel)
            first = await train_one_step(stream, "before", (await describe(channel)).policy_version)
            assert first.weights_pushed and await serving_version(policy) == first.policy_version
            policy.kill()
            # Trained while the policy server is down: this step's push fails.
            second = await train_one_step(stream, "down", first.policy_version)
            assert not second.weights_pushed
            restarted = start_server(["serve", "policy", "--model", "tiny", "--port", str(port)])
            policy.process, policy.output = restarted.process, restarted.output
            deadline = time.monotonic() + BOUND_S
            while (serving := await serving_version(policy)) != second.policy_version:
                assert time.monotonic() < deadline, (
                    f"the restarted server still serves version {serving}, not the learner's "
                    f"{second.policy_version}, after {BOUND_S:.0f} s"
                )
                await asyncio.sleep(0.5)
            await stream.close()
    finally:
        learner.stop()
