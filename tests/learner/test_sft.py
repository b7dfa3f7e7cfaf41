"""The learner's SFT objective (learner/sft.py) against a masked cross-entropy written out by hand,
in fp32 and in bf16 with fp32 master weights; the buffer's one-objective batches; and, on a real
learner process, SFT groups trained with sft_loss metrics and the refusals with their reasons."""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from learner.buffer import RolloutBuffer
from learner.config import GRPOConfig
from learner.sft import sft_loss
from learner.trainer import GRPOTrainer
from learner.types import Objective, RolloutGroup, TrainSample
from sciproto.channel import make_channel
from sciproto.pb import common_pb2, learner_pb2
from sciproto.processes import ServerProcess, start_server
from tests.learner.learner_fixtures import VOCAB, make_group, tiny_model
from tests.learner.test_learner_service import TrainStream, describe, learner_config, start_learner


@pytest.fixture(scope="module")
def policy() -> Iterator[ServerProcess]:
    server = start_server(["serve", "policy", "--model", "tiny", "--port", "0"])
    yield server
    server.stop()


def _demonstration(rng: random.Random, prompt: int, turns: list[tuple[int, int]]) -> TrainSample:
    """A prompt, then (assistant, environment) token runs: the assistant runs are trained."""
    mask = [0] * prompt
    for assistant, environment in turns:
        mask += [1] * assistant + [0] * environment
    return TrainSample(token_ids=[rng.randrange(VOCAB) for _ in mask], loss_mask=mask,
                       rollout_logprobs=[0.0] * len(mask), policy_versions=[0 if m else -1 for m in mask],
                       reward=1.0)


def _sft_groups(seed: int = 0) -> list[RolloutGroup]:
    rng = random.Random(seed)
    return [
        RolloutGroup(group_id="demo/0", task="t/0", objective=Objective.SFT,
                     samples=[_demonstration(rng, 5, [(4, 3), (6, 0)])]),
        RolloutGroup(group_id="demo/1", task="t/1", objective=Objective.SFT,
                     samples=[_demonstration(rng, 9, [(3, 0)]), _demonstration(rng, 2, [(7, 2), (2, 1)])]),
    ]


def _hand_written(model: torch.nn.Module, groups: list[RolloutGroup]) -> tuple[torch.Tensor, float]:
    """L = -(1/N) sum_i sum_t m_t log(exp(z_t[y_t]) / sum_v exp(z_t[v])), one sequence at a time,
    unpadded, with the softmax written out; and the token accuracy of argmax z_t = y_t."""
    total = torch.zeros((), dtype=torch.float64)
    tokens = correct = 0
    for group in groups:
        for sample in group.samples:
            ids = torch.tensor([sample.token_ids])
            logits = model(input_ids=ids).logits[0].double()
            for t in range(1, len(sample.token_ids)):
                if not sample.loss_mask[t]:
                    continue
                z = logits[t - 1]
                total = total - (z[sample.token_ids[t]] - torch.log(torch.exp(z - z.max()).sum()) - z.max())
                tokens += 1
                correct += int(z.argmax()) == sample.token_ids[t]
    return total / tokens, correct / tokens


@pytest.mark.parametrize(("precision", "tolerance"), [("fp32", 1e-5), ("bf16", 3e-2)])
def test_the_sft_step_matches_a_hand_written_masked_cross_entropy(precision: str, tolerance: float) -> None:
    model = tiny_model(seed=3)
    reference = copy.deepcopy(model)
    groups = _sft_groups()
    # A huge clip norm: the step's gradient is the loss's, unclipped; micro-batches of two sequences.
    trainer = GRPOTrainer(model, GRPOConfig(lr=1e-3, sft_lr=1e-4, max_grad_norm=1e9, precision=precision,
                                            micro_batch_tokens=40))
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    metrics = trainer.train_step(groups)

    expected, accuracy = _hand_written(reference, groups)
    expected.backward()
    assert metrics.trained and metrics.objective == "sft" and metrics.micro_batches > 1
    assert metrics.tokens == sum(s.num_trained_tokens for g in groups for s in g.samples) == 22
    assert math.isclose(metrics.sft_loss, float(expected.detach()), rel_tol=tolerance)
    assert metrics.loss == metrics.sft_loss
    if precision == "fp32":
        assert metrics.sft_token_accuracy == pytest.approx(accuracy)
    got = torch.cat([p.grad.flatten() for p in trainer.model.parameters()])
    want = torch.cat([p.grad.flatten() for p in reference.parameters()]).float()
    assert metrics.grad_norm == pytest.approx(float(want.norm()), rel=tolerance * 10)
    if precision == "fp32":
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    else:
        assert float(torch.nn.functional.cosine_similarity(got, want, dim=0)) > 0.99
    # fp32 masters in every precision, moved at sft_lr (AdamW's first step moves each weight by ~lr).
    for name, param in trainer.model.named_parameters():
        assert param.dtype == torch.float32
        moved = (param.detach() - before[name]).abs().max()
        assert 0 < moved <= 1.5e-4, (name, moved)
    assert trainer.optimizer.param_groups[0]["lr"] == 1e-3  # GRPO steps keep their own rate
    assert (trainer.step, trainer.policy_version) == (1, 1)


def test_the_logit_gradient_is_the_one_written_beside_the_loss() -> None:
    """dL/dz_t = (1/N) m_t (softmax(z_t) - onehot(y_t)), as learner/sft.py says."""
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 11, requires_grad=True)
    ids = torch.randint(0, 11, (2, 6))
    mask = torch.tensor([[0, 1, 1, 0, 1], [0, 0, 1, 1, 0]], dtype=torch.float32)
    loss, sums = sft_loss(logits, ids, mask, num_tokens=5)
    loss.backward()
    expected = torch.zeros_like(logits)
    expected[:, :-1] = mask.unsqueeze(-1) * (torch.softmax(logits[:, :-1].detach(), -1)
                                              - torch.nn.functional.one_hot(ids[:, 1:], 11)) / 5
    torch.testing.assert_close(logits.grad, expected)
    assert float(sums["tokens"]) == 5


async def test_the_buffer_hands_out_one_objective_per_batch() -> None:
    rng = random.Random(0)
    buffer = RolloutBuffer(capacity=8, max_staleness=0)
    sft = _sft_groups()
    grpo = make_group(rng, [1.0, 0.0], group_id="grpo/0", version=0)
    for group in (sft[0], grpo, sft[1]):
        assert await buffer.add(group)
    # Version 5: an SFT group is never stale; a GRPO group of version 0 is.
    assert [g.group_id for g in await buffer.take(4, current_version=0, timeout=5)] == ["demo/0"]
    assert [g.group_id for g in await buffer.take(1, current_version=0, timeout=5)] == ["grpo/0"]
    assert [g.group_id for g in await buffer.take(1, current_version=5, timeout=5)] == ["demo/1"]


def _demo_pb(group_id: str, mask: list[int]) -> learner_pb2.RolloutGroup:
    rng = random.Random(len(group_id))
    rollout = learner_pb2.Rollout(token_ids=[rng.randrange(256) for _ in mask], loss_mask=mask,
                                  rollout_logprobs=[0.0] * len(mask),
                                  reward=common_pb2.Reward(value=1.0, status=common_pb2.REWARD_STATUS_SCORED))
    return learner_pb2.RolloutGroup(group_id=group_id, env="gsm8k", task_id="train/0", rollouts=[rollout],
                                    objective=learner_pb2.TRAIN_OBJECTIVE_SFT)


async def test_a_learner_trains_sft_groups_and_refuses_those_it_cannot(policy: ServerProcess, tmp_path: Path) -> None:
    server = start_learner(learner_config(tmp_path / "run", policy))
    try:
        async with make_channel(server.target) as channel:
            version = (await describe(channel)).policy_version
            stream = TrainStream(channel)
            await stream.send(_demo_pb("sft/nothing", [0] * 8))
            await stream.send(_demo_pb("sft/no-prompt", [1] * 4 + [0] * 4))
            nothing, no_prompt = await stream.receipts(2)
            assert (nothing.accepted, nothing.reason) == (False, "invalid") and "no trainable token" in nothing.detail
            assert (no_prompt.accepted, no_prompt.reason) == (False, "invalid") and "prompt" in no_prompt.detail
            # Demonstrations with a single sample and no version spans: neither no_signal nor invalid.
            for index in range(2):
                await stream.send(_demo_pb(f"sft/{index}", [0] * 4 + [1] * 5 + [0] * 2 + [1] * 3))
            assert all(r.accepted for r in await stream.receipts(2))
            step = await stream.next("step")
            await stream.close()
        assert step.policy_version == version + 1 and step.groups == 2
        assert step.metrics["sft_loss"] > 0 and 0 <= step.metrics["sft_token_accuracy"] <= 1
        assert step.metrics["tokens"] == 16
    finally:
        server.stop()
