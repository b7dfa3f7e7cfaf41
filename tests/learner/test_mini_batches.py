"""The PPO/DAPO update: pi_old once per batch, then `mini_batches` optimizer steps whose ratio
rho = pi_theta / pi_old is clipped, checked against a reference written out here: one forward per
sequence (no padding, micro-batches or shared prefix) and AdamW's update in closed form."""

from __future__ import annotations

import math
import random

import pytest
import torch
from learner_fixtures import make_sample, tiny_model

from learner.config import GRPOConfig
from learner.grpo import TrainSequence, group_advantages, prepare_batch, split_mini_batches
from learner.trainer import GRPOTrainer
from learner.types import RolloutGroup, TrainSample

LR = 0.05  # large: one step moves the policy far enough on the other mini-batch's tokens to clip


def _groups() -> list[RolloutGroup]:
    """Two groups of four 8-token completions: with two mini-batches, one group each."""
    rng = random.Random(11)
    return [
        RolloutGroup(group_id=name, task="toy", samples=[
            make_sample(rng, reward, completion_len=8, index=i) for i, reward in enumerate(rewards)])
        for name, rewards in (("a", [1.0, 0.0, 0.5, 0.0]), ("b", [0.2, 0.9, 0.9, 0.1]))
    ]


def _logprobs(model: torch.nn.Module, sample: TrainSample) -> torch.Tensor:
    """log pi(y_t | y_<t) for t >= 1 from a forward of this sequence alone."""
    ids = torch.tensor([sample.token_ids])
    logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    return logp.gather(-1, ids[0, 1:, None])[:, 0]


class _Adam:
    """AdamW without weight decay, written out: m = b1 m + (1 - b1) g, v = b2 v + (1 - b2) g^2,
    theta -= lr (m / (1 - b1^k)) / (sqrt(v / (1 - b2^k)) + eps)."""

    def __init__(self, params: list[torch.nn.Parameter], cfg: GRPOConfig) -> None:
        self.params, self.cfg, self.k = params, cfg, 0
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]

    @torch.no_grad()
    def step(self) -> None:
        (b1, b2), self.k = self.cfg.adam_betas, self.k + 1
        for p, m, v in zip(self.params, self.m, self.v):
            m.mul_(b1).add_((1 - b1) * p.grad)
            v.mul_(b2).add_((1 - b2) * p.grad**2)
            p -= self.cfg.lr * (m / (1 - b1**self.k)) / ((v / (1 - b2**self.k)).sqrt() + 1e-8)


def _reference_update(groups: list[RolloutGroup], parts: list[list[str]], cfg: GRPOConfig):
    """The whole batch's update by hand. `parts` names each mini-batch's groups. Returns the token
    mean of the per-token losses (each at its own step), the clipped-token counts, and the model."""
    model = tiny_model()
    adam = _Adam(list(model.parameters()), cfg)
    samples = {g.group_id: list(zip(g.samples, group_advantages([s.reward for s in g.samples], cfg.adv_eps)))
               for g in groups}
    with torch.no_grad():  # pi_old: the weights before the batch's first update
        old = {id(s): _logprobs(model, s) for g in groups for s in g.samples}
    total_tokens = sum(s.num_trained_tokens for g in groups for s in g.samples)
    loss_total, clip_low, clip_high = 0.0, 0, 0
    for part in parts:
        objective, tokens = 0.0, 0
        model.zero_grad()
        for sample, advantage in (pair for name in part for pair in samples[name]):
            logprobs = _logprobs(model, sample)
            for t, trained in enumerate(sample.loss_mask[1:]):
                if not trained:
                    continue
                tokens += 1
                rho = torch.exp(logprobs[t] - old[id(sample)][t])
                w = min(math.exp(old[id(sample)][t].item() - sample.rollout_logprobs[t + 1]), cfg.is_cap)
                clipped = rho.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
                objective = objective + w * torch.minimum(rho * advantage, clipped * advantage)
                clip_low += int(advantage < 0 and rho.item() < 1 - cfg.eps_low)
                clip_high += int(advantage > 0 and rho.item() > 1 + cfg.eps_high)
        loss = -objective / tokens  # L_k = -(1/N_k) sum_{t in k} J_t
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        adam.step()
        loss_total += loss.item() * tokens / total_tokens
    return loss_total, clip_low, clip_high, total_tokens, model


def test_the_batch_splits_in_order_into_parts_of_equal_trained_tokens() -> None:
    plan = prepare_batch(_groups(), GRPOConfig())
    parts = split_mini_batches(plan.sequences, 2)
    assert [len(p) for p in parts] == [4, 4]  # group a, then group b
    assert [s for p in parts for s in p] == plan.sequences

    def seq(trained: int) -> TrainSequence:
        mask = torch.tensor([0.0] + [1.0] * trained)
        return TrainSequence(torch.zeros(trained + 1, dtype=torch.long), mask, torch.zeros(trained + 1), 1.0)

    uneven = [seq(n) for n in (10, 1, 1, 1, 1, 6)]  # 20 tokens: halves end after the 10 and the 6
    assert [len(p) for p in split_mini_batches(uneven, 2)] == [1, 5]
    assert [len(p) for p in split_mini_batches(uneven[:2], 4)] == [1, 1]  # never an empty part


@pytest.mark.parametrize("count", [1, 2])
def test_the_update_matches_the_reference(count: int) -> None:
    cfg = GRPOConfig(lr=LR, mini_batches=count, micro_batch_tokens=40)
    groups = _groups()
    expected_loss, low, high, tokens, reference = _reference_update(
        groups, [["a", "b"]] if count == 1 else [["a"], ["b"]], cfg)

    trainer = GRPOTrainer(tiny_model(), cfg)
    metrics = trainer.train_step(groups)
    assert (metrics.optimizer_steps, metrics.policy_version, metrics.tokens) == (count, 1, tokens)
    assert metrics.micro_batches > count  # pi_old and the steps went through micro-batches
    assert metrics.loss == pytest.approx(expected_loss, rel=1e-4)
    assert metrics.clip_frac_low == pytest.approx(low / tokens)
    assert metrics.clip_frac_high == pytest.approx(high / tokens)
    if count == 1:
        # One step: pi_old is the policy being trained, rho = 1, nothing clips.
        assert low == high == 0
    else:
        # The second step sees tokens the first step moved: the clip bounds it.
        assert low > 0 and high > 0
    # Adam moves a weight by ~lr * g / (|g| + 1e-8): for a gradient within ~1e-8 of zero the move
    # follows the float rounding of g (batched vs one sequence at a time); a wrong step is ~lr.
    for (name, got), want in zip(trainer.model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=LR * 1e-2, msg=name)
