"""LearnerService on real processes: a policy server with the tiny model and a learner that pushes
its weights to it, driven over loopback gRPC."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from sciproto.channel import make_channel
from sciproto.client.policy import PolicyClient
from sciproto.pb import common_pb2, learner_grpc, learner_pb2, policy_pb2
from sciproto.processes import ServerProcess, start_server

BATCH_GROUPS = 2
EVENT_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def policy() -> Iterator[ServerProcess]:
    server = start_server(["serve", "policy", "--model", "tiny", "--port", "0"])
    yield server
    server.stop()


def learner_config(run_dir: Path, policy: ServerProcess, **extra: object) -> Path:
    config = {
        "learner": {
            "model": "tiny",
            "batch_groups": BATCH_GROUPS,
            "buffer_capacity": 8,
            "policy_targets": [policy.target],
            "run_dir": str(run_dir),
            "grpo": {"lr": 1e-2, "max_staleness": 0},
            **extra,
        }
    }
    path = run_dir.parent / f"{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def start_learner(config: Path) -> ServerProcess:
    return start_server(["serve", "learner", "--config", str(config), "--port", "0"])


@pytest.fixture(scope="module")
def learner(
    policy: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    run_dir = tmp_path_factory.mktemp("learner") / "run"
    server = start_learner(learner_config(run_dir, policy))
    yield server
    server.stop()


def make_group(
    group_id: str, version: int, rewards: tuple[float, ...] = (1.0, 0.0, 0.5, 0.2), seed: int = 0
) -> learner_pb2.RolloutGroup:
    """Byte tokens: a 4-token prompt and a 5-token completion per sample, sampled at `version`."""
    rng = random.Random(seed)
    rollouts = []
    for index, reward in enumerate(rewards):
        tokens = [rng.randrange(256) for _ in range(9)]
        rollouts.append(
            learner_pb2.Rollout(
                sample_index=index,
                token_ids=tokens,
                loss_mask=[0] * 4 + [1] * 5,
                rollout_logprobs=[0.0] * 4 + [-5.5] * 5,
                version_spans=[common_pb2.VersionSpan(start=4, end=9, policy_version=version)],
                reward=common_pb2.Reward(value=reward, status=common_pb2.REWARD_STATUS_SCORED),
                turns=1,
            )
        )
    return learner_pb2.RolloutGroup(
        group_id=group_id, env="toy", task_id="train/0", rollouts=rollouts
    )


class TrainStream:
    """One TrainStep call: write groups, read events with a timeout."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.call = learner_grpc.LearnerServiceStub(channel).TrainStep()

    async def send(self, group: learner_pb2.RolloutGroup) -> None:
        await self.call.write(learner_pb2.TrainStepRequest(group=group))

    async def next(self, kind: str) -> learner_pb2.TrainStepResponse:
        """The next event of `kind` ("receipt", "step" or "error"); others are skipped."""
        while True:
            event = await asyncio.wait_for(self.call.read(), EVENT_TIMEOUT_S)
            assert event is not grpc.aio.EOF, f"the stream ended while waiting for a {kind}"
            if event.WhichOneof("event") == kind:
                return getattr(event, kind)

    async def receipts(self, count: int) -> list[learner_pb2.GroupReceipt]:
        return [await self.next("receipt") for _ in range(count)]

    async def close(self) -> list[learner_pb2.TrainStepResponse]:
        """Half-close and read to the end of the stream."""
        await self.call.done_writing()
        rest = []
        while (
            event := await asyncio.wait_for(self.call.read(), EVENT_TIMEOUT_S)
        ) is not grpc.aio.EOF:
            rest.append(event)
        return rest


async def describe(channel: grpc.aio.Channel) -> learner_pb2.LearnerServiceDescribeResponse:
    return await learner_grpc.LearnerServiceStub(channel).Describe(
        learner_pb2.LearnerServiceDescribeRequest(), timeout=30
    )


async def serving_version(policy: ServerProcess) -> int:
    async with PolicyClient(policy.target) as client:
        return (await client.describe(timeout_s=30)).policy_version


async def test_groups_get_receipts_and_a_step_that_pushes_weights(
    learner: ServerProcess, policy: ServerProcess
) -> None:
    async with make_channel(learner.target) as channel:
        before = await describe(channel)
        assert before.model.startswith("tiny") and before.max_staleness == 0
        version = before.policy_version
        stream = TrainStream(channel)
        for number in range(BATCH_GROUPS):
            await stream.send(make_group(f"receipts/{number}", version, seed=number))
        receipts = await stream.receipts(BATCH_GROUPS)
        assert [r.accepted for r in receipts] == [True] * BATCH_GROUPS
        step = await stream.next("step")
        assert step.step == before.step + 1
        assert step.policy_version == version + 1
        assert step.groups == BATCH_GROUPS and step.weights_pushed
        for key in (
            "reward_mean",
            "loss",
            "entropy",
            "policy_lag_mean",
            "train_s",
            "weight_sync_s",
            "peak_rss_gb",
        ):
            assert key in step.metrics
        assert step.metrics["peak_rss_gb"] > 0.1 and "peak_gpu_gb" not in step.metrics  # no CUDA: not sent
        assert step.metrics["reward_mean"] == pytest.approx(0.425)
        await stream.close()
        assert await serving_version(policy) == version + 1
        after = await describe(channel)
        assert (after.step, after.policy_version) == (step.step, step.policy_version)


async def test_a_duplicate_group_is_refused(learner: ServerProcess) -> None:
    """A copy sent while the first still waits (a client that reconnected) is accepted again
    but buffered once; a copy of a group already trained is refused and says so."""
    async with make_channel(learner.target) as channel:
        version = (await describe(channel)).policy_version
        stream = TrainStream(channel)
        await stream.send(make_group("dup/0", version))
        await stream.send(make_group("dup/0", version))
        first, second = await stream.receipts(2)
        assert first.accepted and second.accepted
        await stream.send(make_group("dup/1", version, seed=1))  # completes the batch
        await stream.receipts(1)
        step = await stream.next("step")
        assert sorted(step.consumed_group_ids) == ["dup/0", "dup/1"]
        await stream.send(make_group("dup/0", version))
        (third,) = await stream.receipts(1)
        assert (third.accepted, third.reason, third.detail) == (False, "duplicate", "consumed")
        await stream.close()
        assert (await describe(channel)).buffer.groups_duplicate >= 1


async def test_a_stale_group_is_dropped_and_counted(learner: ServerProcess) -> None:
    async with make_channel(learner.target) as channel:
        before = await describe(channel)
        assert before.policy_version >= 1, "an earlier test trained a step"
        stream = TrainStream(channel)
        # max_staleness 0: tokens of any older version may not train.
        await stream.send(make_group("stale/0", before.policy_version - 1))
        (receipt,) = await stream.receipts(1)
        assert not receipt.accepted and receipt.reason == "stale"
        await stream.close()
        after = await describe(channel)
        assert after.buffer.groups_dropped_stale == before.buffer.groups_dropped_stale + 1
        assert after.step == before.step


async def test_a_malformed_group_is_refused_and_the_stream_goes_on(learner: ServerProcess) -> None:
    async with make_channel(learner.target) as channel:
        version = (await describe(channel)).policy_version
        broken = make_group("malformed/0", version)
        del broken.rollouts[1].loss_mask[-1]  # no longer aligned with token_ids
        stream = TrainStream(channel)
        await stream.send(broken)
        await stream.send(make_group("malformed/1", version))
        bad, good = await stream.receipts(2)
        assert not bad.accepted and bad.reason == "invalid"
        assert "loss_mask" in bad.detail
        assert good.accepted
        await stream.send(make_group("malformed/2", version, seed=2))
        await stream.receipts(1)
        assert (await stream.next("step")).groups == BATCH_GROUPS
        await stream.close()


async def test_poisoned_groups_are_refused_before_they_reach_the_optimizer(
    learner: ServerProcess,
) -> None:
    """A NaN logprob or reward, or a token id outside the vocabulary, would turn the step (and
    every policy server after the push) NaN, or fail it: each is an "invalid" receipt."""
    async with make_channel(learner.target) as channel:
        version = (await describe(channel)).policy_version
        nan_logprob = make_group("poison/logprob", version)
        nan_logprob.rollouts[0].rollout_logprobs[-1] = float("nan")
        inf_reward = make_group("poison/reward", version)
        inf_reward.rollouts[2].reward.value = float("inf")
        out_of_vocab = make_group("poison/token", version)
        out_of_vocab.rollouts[3].token_ids[6] = 10**6
        stream = TrainStream(channel)
        for group in (nan_logprob, inf_reward, out_of_vocab):
            await stream.send(group)
        receipts = await stream.receipts(3)
        await stream.close()
    assert [(r.accepted, r.reason) for r in receipts] == [(False, "invalid")] * 3
    assert "finite" in receipts[0].detail and "finite" in receipts[1].detail
    assert "vocabulary" in receipts[2].detail


async def test_a_checkpoint_cannot_be_written_outside_the_run_directory(learner: ServerProcess) -> None:
    async with make_channel(learner.target) as channel:
        stub = learner_grpc.LearnerServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.SaveCheckpoint(learner_pb2.SaveCheckpointRequest(directory="../../elsewhere"))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "run directory" in refused.value.details()


async def test_a_killed_learner_resumes_from_its_checkpoint_without_counting_a_group_twice(
    policy: ServerProcess, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    config = learner_config(run_dir, policy, checkpoint_every=1)
    server = start_learner(config)
    try:
        async with make_channel(server.target) as channel:
            version = (await describe(channel)).policy_version
            groups = [make_group(f"resume/{n}", version, seed=n) for n in range(BATCH_GROUPS)]
            stream = TrainStream(channel)
            for group in groups:
                await stream.send(group)
            await stream.receipts(BATCH_GROUPS)
            step = await stream.next("step")
            # The automatic checkpoint follows the step result; wait for it to land.
            for _ in range(300):
                if list((run_dir / "checkpoints").glob("step_00000001/learner_state.json")):
                    break
                await asyncio.sleep(0.1)
        server.kill()  # SIGKILL: no shutdown checkpoint
        state = json.loads(
            next((run_dir / "checkpoints").glob("step_*/learner_state.json")).read_text()
        )
        assert sorted(state["trained_group_ids"]) == sorted(g.group_id for g in groups)

        server = start_learner(config)
        async with make_channel(server.target) as channel:
            resumed = await describe(channel)
            assert resumed.step == step.step == 1
            # Versions only grow: the policy server already serves the checkpoint's version, so
            # the learner continued above it and both agree.
            assert resumed.policy_version > step.policy_version
            assert await serving_version(policy) == resumed.policy_version
            stream = TrainStream(channel)
            for group in groups:
                await stream.send(group)
            receipts = await stream.receipts(BATCH_GROUPS)
            assert [r.reason for r in receipts] == ["duplicate"] * BATCH_GROUPS
            await stream.close()
            assert (await describe(channel)).step == 1
    finally:
        server.stop()


async def test_a_bf16_learner_pushes_what_a_bfloat16_policy_server_serves(tmp_path: Path) -> None:
    """bf16 compute over fp32 masters; push_dtype auto asks the policy server (Describe) and the
    push carries bfloat16, which the server accepts only in the dtype it holds."""
    policy = start_server(["serve", "policy", "--model", "tiny", "--port", "0", "--set", "dtype=bfloat16"])
    learner = start_learner(learner_config(tmp_path / "run", policy, grpo={"lr": 1e-6, "precision": "bf16"}))
    try:
        async with make_channel(learner.target) as channel:
            before = await describe(channel)
            assert before.precision == "bf16"
            stream = TrainStream(channel)
            for number in range(BATCH_GROUPS):
                await stream.send(make_group(f"bf16/{number}", before.policy_version, seed=number))
            await stream.receipts(BATCH_GROUPS)
            step = await stream.next("step")
            assert step.weights_pushed
            await stream.close()
        assert await serving_version(policy) == step.policy_version
    finally:
        learner.stop()
        policy.stop()


async def test_samples_cut_by_their_token_limit_are_counted_and_masked(
    policy: ServerProcess, tmp_path: Path
) -> None:
    """Finish reasons travel in the Rollout; with mask_truncated the step trains none of a cut
    sample's tokens and says how many it masked. An unknown finish reason is refused."""
    learner = start_learner(learner_config(tmp_path / "run", policy, grpo={"lr": 1e-2, "mask_truncated": True}))
    try:
        async with make_channel(learner.target) as channel:
            version = (await describe(channel)).policy_version
            groups = [make_group(f"cut/{n}", version, seed=n) for n in range(BATCH_GROUPS)]
            for group in groups:
                for index, rollout in enumerate(group.rollouts):
                    cut = index == 1  # one sample per group ran into its token limit
                    rollout.turn_finish_reasons.append(
                        policy_pb2.FINISH_REASON_LENGTH if cut else policy_pb2.FINISH_REASON_STOP)
                    rollout.step_rewards.append(0.0)
            unknown = make_group("cut/unknown", version)
            unknown.rollouts[0].turn_finish_reasons.append(99)
            stream = TrainStream(channel)
            for group in [unknown, *groups]:
                await stream.send(group)
            refused, *accepted = await stream.receipts(1 + BATCH_GROUPS)
            assert not refused.accepted and refused.reason == "invalid"
            assert "turn_finish_reasons[0] = 99" in refused.detail
            assert all(r.accepted for r in accepted)
            step = await stream.next("step")
            await stream.close()
    finally:
        learner.stop()
    assert step.metrics["length_cut_samples"] == BATCH_GROUPS
    assert step.metrics["truncated_masked_samples"] == BATCH_GROUPS
    # 4 samples x 5 trained tokens per group, one sample masked in each.
    assert step.metrics["tokens"] == BATCH_GROUPS * 3 * 5
