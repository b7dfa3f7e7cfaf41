"""A learner SIGKILLed at any point of an optimizer step (after training, after its metrics line,
between the checkpoint's files, after the checkpoint) and started again trains and counts every
group exactly once: the groups a client saw consumed are in the resumed learner's checkpoint and
in exactly one metrics line, and the others come back when the client sends them again.

Real learner and policy processes; the learner holds at the chosen point (learner.faults.hold_at)
so that the SIGKILL lands exactly there; the client side is the rollout client's own ledger."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from server_output import wait_for_line
from test_learner_service import (
    BATCH_GROUPS,
    EVENT_TIMEOUT_S,
    TrainStream,
    describe,
    learner_config,
    make_group,
    start_learner,
)

from clients.train.flow import GroupLedger
from learner.metrics import read_metrics
from learner.service import LEARNER_STATE_FILE, latest_learner_checkpoint
from sciproto.channel import make_channel
from sciproto.pb import learner_pb2
from sciproto.processes import ServerProcess, start_server

HELD_STEP = 2
SETTLE_S = 1.0  # time for whatever the learner sent before it held to reach the client


@pytest.fixture(scope="module")
def policy() -> Iterator[ServerProcess]:
    server = start_server(["serve", "policy", "--model", "tiny", "--port", "0"])
    yield server
    server.stop()


async def feed(stream: TrainStream, ledger: GroupLedger) -> None:
    """Every event of `stream` into the ledger, until the stream breaks."""
    with contextlib.suppress(grpc.RpcError):
        while (event := await stream.call.read()) is not grpc.aio.EOF:
            kind = event.WhichOneof("event")
            if kind == "receipt":
                ledger.on_receipt(event.receipt)
            elif kind == "step":
                ledger.on_step(event.step)
            elif kind == "step_failure":
                ledger.on_step_failure(event.step_failure)


async def resend_what_has_no_fate(stream: TrainStream, ledger: GroupLedger) -> list:
    """Send again every group the client heard no fate of, as the rollout client does after a
    learner restart; the receipts go into the ledger and are returned."""
    resend = ledger.to_resend()
    for request in resend:
        await stream.send(request.group)
    receipts = await stream.receipts(len(resend))
    for receipt in receipts:
        ledger.on_receipt(receipt)
    return receipts


@pytest.mark.parametrize("point", ["after_train", "after_metrics", "in_checkpoint", "after_checkpoint"])
async def test_a_learner_killed_at_any_point_of_a_step_counts_every_group_once(
    policy: ServerProcess, tmp_path: Path, point: str
) -> None:
    run_dir = tmp_path / "run"
    settings = {"checkpoint_every": 1, "grpo": {"lr": 1e-2, "max_staleness": 4}}
    ledger = GroupLedger()
    ids = [f"g/{n}" for n in range(2 * BATCH_GROUPS)]
    learner = start_learner(learner_config(
        run_dir, policy, faults={"hold_at": point, "hold_step": HELD_STEP}, **settings))
    try:
        async with make_channel(learner.target) as channel:
            version = (await describe(channel)).policy_version
            stream = TrainStream(channel)
            reader = asyncio.ensure_future(feed(stream, ledger))
            for n, group_id in enumerate(ids):  # step 1 trains as usual, step 2 holds at `point`
                request = learner_pb2.TrainStepRequest(group=make_group(group_id, version, seed=n))
                ledger.add(request)
                ledger.sent.add(group_id)
                await stream.send(request.group)
            await wait_for_line(learner, f"holding at {point} of step {HELD_STEP}", EVENT_TIMEOUT_S)
            await asyncio.sleep(SETTLE_S)
            learner.kill()  # SIGKILL: no shutdown checkpoint
            await asyncio.wait_for(reader, EVENT_TIMEOUT_S)
        acked_before_kill = {g for g, fates in ledger.fates.items() if fates}

        # Started again on the same run directory (without the hold), the client sends every
        # group it has no fate for on a new stream, as the rollout client does.
        learner = start_learner(learner_config(run_dir, policy, **settings))
        async with make_channel(learner.target) as channel:
            stream = TrainStream(channel)
            receipts = await resend_what_has_no_fate(stream, ledger)
            if sum(r.accepted for r in receipts):
                ledger.on_step(await stream.next("step"))
            await stream.call.done_writing()
            await asyncio.wait_for(feed(stream, ledger), EVENT_TIMEOUT_S)
    finally:
        learner.stop()

    assert all(len(fates) == 1 for fates in ledger.fates.values()), ledger.fates
    assert {g: fates[0] for g, fates in ledger.fates.items()} == dict.fromkeys(ids, "consumed"), (
        f"acked before the kill: {sorted(acked_before_kill)}")
    lines = read_metrics(run_dir / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1, 2], lines
    assert sum(line["groups_consumed"] for line in lines) == len(ids), (
        f"metrics lines count {[line['groups_consumed'] for line in lines]} groups; the client "
        f"saw {len(ids)} consumed ({sorted(acked_before_kill)} before the kill)")
    checkpoint = latest_learner_checkpoint(run_dir)
    assert checkpoint is not None
    state = json.loads((checkpoint / LEARNER_STATE_FILE).read_text())
    assert sorted(state["trained_group_ids"]) == ids, (
        f"groups the client saw consumed are missing from the model's checkpoint; acked before "
        f"the kill: {sorted(acked_before_kill)}")


async def test_a_group_a_checkpointed_step_dropped_stale_is_refused_as_such_when_sent_again(
    policy: ServerProcess, tmp_path: Path
) -> None:
    """Killed after the checkpoint of a step that dropped a group as stale, before the client
    heard of that step: the resent group's receipt names it dropped stale, as metrics.jsonl
    counts it, instead of taking it as new (refused stale or trained: counted twice)."""
    run_dir = tmp_path / "run"
    settings = {"checkpoint_every": 1, "grpo": {"lr": 1e-2, "max_staleness": 0}}
    ledger = GroupLedger()

    def add(group_id: str, version: int, seed: int) -> learner_pb2.RolloutGroup:
        request = learner_pb2.TrainStepRequest(group=make_group(group_id, version, seed=seed))
        ledger.add(request)
        ledger.sent.add(group_id)
        return request.group

    learner = start_learner(learner_config(
        run_dir, policy, faults={"hold_at": "after_checkpoint", "hold_step": 2}, **settings))
    try:
        async with make_channel(learner.target) as channel:
            version = (await describe(channel)).policy_version
            stream = TrainStream(channel)
            reader = asyncio.ensure_future(feed(stream, ledger))
            # Step 1 takes old/0 and old/1; old/2 waits and is stale once step 1 bumped the version.
            for n in range(BATCH_GROUPS + 1):
                await stream.send(add(f"old/{n}", version, n))
            deadline = time.monotonic() + EVENT_TIMEOUT_S
            while ledger.fates["old/0"] != ["consumed"]:
                assert time.monotonic() < deadline, ledger.fates
                await asyncio.sleep(0.1)
            after_first = (await describe(channel)).policy_version
            for n in range(BATCH_GROUPS):  # step 2: drops old/2, trains new/0 and new/1
                await stream.send(add(f"new/{n}", after_first, 10 + n))
            await wait_for_line(learner, "holding at after_checkpoint of step 2", EVENT_TIMEOUT_S)
            await asyncio.sleep(SETTLE_S)
            learner.kill()
            await asyncio.wait_for(reader, EVENT_TIMEOUT_S)
        learner = start_learner(learner_config(run_dir, policy, **settings))
        async with make_channel(learner.target) as channel:
            stream = TrainStream(channel)
            await resend_what_has_no_fate(stream, ledger)
            await stream.call.done_writing()
            await asyncio.wait_for(feed(stream, ledger), EVENT_TIMEOUT_S)
    finally:
        learner.stop()

    fates = {g: f for g, f in ledger.fates.items()}
    assert all(len(f) == 1 for f in fates.values()), fates
    assert fates["old/2"] == ["dropped_stale"], fates
    lines = read_metrics(run_dir / "metrics.jsonl")
    assert [line["groups_dropped_stale"] for line in lines] == [0, 1], lines
    assert sum(line["groups_consumed"] for line in lines) == sum(
        f == ["consumed"] for f in fates.values()) == 2 * BATCH_GROUPS
