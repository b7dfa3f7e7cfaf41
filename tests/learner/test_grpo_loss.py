"""The GRPO loss against hand computations, and its batching invariances."""

from __future__ import annotations

import math
import random

import pytest
import torch
from learner_fixtures import make_group, tiny_model, with_shared_prompt

from learner.config import GRPOConfig
from learner.grpo import (
    group_advantages,
    grpo_loss,
    prepare_batch,
    split_into_transitions,
)
from learner.trainer import GRPOTrainer
from learner.types import RewardStatus, RolloutGroup, TrainSample


def test_advantages_are_group_normalised() -> None:
    # mean 0.5, population std 0.5 -> A = +-1
    assert group_advantages([1.0, 0.0, 0.0, 1.0], adv_eps=0.0) == [1.0, -1.0, -1.0, 1.0]
    a = group_advantages([3.0, 1.0, 2.0], adv_eps=1e-6)
    std = math.sqrt(2 / 3)
    assert a == pytest.approx([1 / std, -1 / std, 0.0], rel=1e-5)


def test_groups_without_signal_are_counted_and_skipped(rng: random.Random) -> None:
    groups = [
        make_group(rng, [0.5, 0.5, 0.5], group_id="equal"),
        make_group(
            rng,
            [1.0, 0.0],
            group_id="one-scored",
            statuses=[RewardStatus.SCORED, RewardStatus.INFRA_ERROR],
        ),
        make_group(rng, [1.0, 0.0], group_id="ok"),
    ]
    plan = prepare_batch(groups, GRPOConfig())
    assert plan.groups == 3
    assert plan.groups_skipped_all_equal == 2
    assert len(plan.sequences) == 2
    assert plan.num_tokens == sum(s.num_trained_tokens for s in groups[2].samples)


def test_infra_errors_are_masked_never_scored_zero(rng: random.Random) -> None:
    statuses = [
        RewardStatus.SCORED,
        RewardStatus.SCORED,
        RewardStatus.INFRA_ERROR,
        RewardStatus.UNSCORED,
    ]
    group = make_group(rng, [1.0, 0.0, 0.0, 0.0], statuses=statuses)
    plan = prepare_batch([group], GRPOConfig(adv_eps=1e-9))
    # Only the two scored samples train; read as a 0 reward the failure would shift the mean.
    assert [s.advantage for s in plan.sequences] == pytest.approx([1.0, -1.0])
    assert plan.infra_error_samples == 1 and plan.unscored_samples == 1
    assert plan.num_tokens == sum(s.num_trained_tokens for s in group.samples[:2])
    assert plan.scored_rewards == [1.0, 0.0]


def _hand_loss(lp, old, mu, adv, mask, n, cfg: GRPOConfig) -> float:
    """The per-token objective written out with floats, one token at a time."""
    total = 0.0
    for i in range(len(lp)):
        for t in range(len(lp[i])):
            if not mask[i][t]:
                continue
            rho = math.exp(lp[i][t] - old[i][t])
            ratio = math.exp(old[i][t] - mu[i][t])
            if cfg.is_correction == "truncate":
                w = min(ratio, cfg.is_cap)
            elif cfg.is_correction == "mask":
                if ratio > cfg.is_cap:
                    continue
                w = ratio
            else:
                w = 1.0
            clipped = min(max(rho, 1 - cfg.eps_low), 1 + cfg.eps_high)
            total += w * min(rho * adv[i], clipped * adv[i])
    return -total / n


@pytest.mark.parametrize("mode", ["truncate", "mask", "off"])
def test_token_loss_matches_hand_computation(mode: str) -> None:
    cfg = GRPOConfig(is_correction=mode)
    # rho per token: e^0.5 (clipped high for A>0), e^-0.5 (clipped low for A<0), e^0.1, 1
    lp = [[-1.0, -1.5, -2.0, -0.9], [-1.0, -1.5, -2.0, -0.9]]
    old = [[-1.5, -1.0, -2.1, -0.9], [-1.5, -1.0, -2.1, -0.9]]
    # pi_old/mu per token: e^1.5 (over the cap), e^-0.5, e^0.2, e^0
    mu = [[-3.0, -0.5, -2.3, -0.9], [-3.0, -0.5, -2.3, -0.9]]
    adv = [1.0, -1.0]
    mask = [[1, 1, 1, 0], [1, 1, 1, 1]]
    n = 10  # the whole batch's tokens: this micro-batch holds 7 of them
    loss, stats = grpo_loss(
        torch.tensor(lp),
        torch.tensor(old),
        torch.tensor(mu),
        torch.tensor(adv),
        torch.tensor(mask, dtype=torch.float32),
        n,
        cfg,
    )
    assert loss.item() == pytest.approx(_hand_loss(lp, old, mu, adv, mask, n, cfg), rel=1e-6)
    # A>0 row: token 0 has rho e^0.5 > 1.28 -> clipped high; A<0 row: token 1 has e^-0.5 < 0.8.
    assert stats["clip_high"].item() == 1 and stats["clip_low"].item() == 1
    assert stats["is_truncated"].item() == 2  # e^1.5 > 2 in both rows
    assert stats["tokens"].item() == 7


def test_clip_stops_the_gradient_beyond_the_trust_region() -> None:
    cfg = GRPOConfig(is_correction="off")
    old = torch.zeros(1, 2)
    lp = torch.tensor([[0.5, 0.1]], requires_grad=True)  # rho = e^0.5 (clipped), e^0.1 (inside)
    loss, _ = grpo_loss(lp, old, old, torch.tensor([1.0]), torch.ones(1, 2), 2, cfg)
    loss.backward()
    assert lp.grad[0, 0].item() == 0.0
    assert lp.grad[0, 1].item() == pytest.approx(-math.exp(0.1) / 2)


def _sequence_logprobs(model: torch.nn.Module, sample: TrainSample) -> list[float]:
    """log pi(y_t | y_<t) from a forward pass of this sequence alone (no padding, no batching)."""
    ids = torch.tensor([sample.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    return logp.gather(-1, ids[0, 1:, None])[:, 0].tolist()


def test_trainer_loss_matches_hand_computation_on_a_model(groups: list[RolloutGroup]) -> None:
    """End to end through padding, micro-batches and the model: with one optimizer step per batch
    (mini_batches 1) pi_old = pi_theta, rho = 1 and the loss is -(1/N) sum_t min(pi/mu, 2) A_i."""
    cfg = GRPOConfig(micro_batch_tokens=32, adv_eps=1e-6)
    reference = tiny_model()
    expected, n = 0.0, 0
    for group in groups:
        rewards = [s.reward for s in group.samples]
        advantages = group_advantages(rewards, cfg.adv_eps)
        if advantages is None:
            continue
        for sample, a in zip(group.samples, advantages):
            logp = _sequence_logprobs(reference, sample)
            for t, m in enumerate(sample.loss_mask[1:]):
                if m:
                    n += 1
                    expected += min(math.exp(logp[t] - sample.rollout_logprobs[t + 1]), 2.0) * a
    expected = -expected / n

    metrics = GRPOTrainer(tiny_model(), cfg).train_step(groups)
    assert metrics.micro_batches > 1
    assert metrics.tokens == n
    assert metrics.loss == pytest.approx(expected, rel=1e-4, abs=1e-6)
    assert metrics.groups_skipped_all_equal == 1
    assert metrics.frac_all_equal_groups == pytest.approx(1 / 3)
    assert metrics.clip_frac_low == 0.0 and metrics.clip_frac_high == 0.0
    assert metrics.mismatch > 1.0 and metrics.entropy > 0.0
    assert metrics.policy_version == 1


def test_adamw_runs_its_fused_kernel_on_cpu_weights_and_moves_them_as_the_default_does(
        groups: list[RolloutGroup]) -> None:
    config = GRPOConfig(lr=1e-3)
    fused = GRPOTrainer(tiny_model(), config)
    assert fused.optimizer.defaults["fused"] is True
    default = GRPOTrainer(tiny_model(), config)
    default.optimizer = torch.optim.AdamW(default.trainable, lr=config.lr, betas=config.adam_betas,
                                          weight_decay=config.weight_decay)
    for _ in range(2):
        fused.train_step(groups)
        default.train_step(groups)
    moved = 0
    for (name, got), want, start in zip(fused.model.named_parameters(), default.model.parameters(),
                                        tiny_model().parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
        moved += int(not torch.equal(got, start))
    assert moved > 0


def _loss_and_grads(groups: list[RolloutGroup], **config) -> tuple[float, list[torch.Tensor]]:
    trainer = GRPOTrainer(tiny_model(), GRPOConfig(max_grad_norm=1e9, **config))
    metrics = trainer.train_step(groups)
    return metrics.loss, [p.grad.clone() for p in trainer.model.parameters()]


def test_micro_batches_sum_to_the_full_batch_loss_and_gradient(
    groups: list[RolloutGroup],
) -> None:
    full_loss, full_grads = _loss_and_grads(groups, micro_batch_tokens=100_000)
    split_loss, split_grads = _loss_and_grads(groups, micro_batch_tokens=16)
    assert split_loss == pytest.approx(full_loss, rel=1e-5)
    for a, b in zip(full_grads, split_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_per_transition_mode_keeps_the_loss(rng: random.Random) -> None:
    # Two assistant turns separated by an environment observation.
    mask = [0, 0, 1, 1, 1, 0, 0, 1, 1]
    samples = [
        TrainSample(
            token_ids=[rng.randrange(300) for _ in mask],
            loss_mask=mask,
            rollout_logprobs=[-5.0 * m for m in mask],
            policy_versions=[0 if m else -1 for m in mask],
            reward=r,
            sample_index=i,
        )
        for i, r in enumerate([1.0, 0.0, 0.5])
    ]
    parts = split_into_transitions(samples[0])
    assert [p.loss_mask for p in parts] == [[0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 1, 1]]
    assert all(p.reward == 1.0 for p in parts)

    groups = [RolloutGroup(group_id="multi-turn", task="toy", samples=samples)]
    whole_loss, whole_grads = _loss_and_grads(groups)
    split_loss, split_grads = _loss_and_grads(groups, per_transition=True)
    assert split_loss == pytest.approx(whole_loss, rel=1e-5)
    for a, b in zip(whole_grads, split_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_reference_kl_starts_at_zero_and_enters_the_loss(groups: list[RolloutGroup]) -> None:
    trainer = GRPOTrainer(tiny_model(), GRPOConfig(kl_coef=0.1, lr=1e-2))
    first = trainer.train_step(groups)
    second = trainer.train_step(groups)
    assert first.kl == pytest.approx(0.0, abs=1e-9)
    assert second.kl > 0.0


def test_batch_without_signal_trains_nothing(rng: random.Random) -> None:
    trainer = GRPOTrainer(tiny_model(), GRPOConfig())
    before = [p.detach().clone() for p in trainer.model.parameters()]
    metrics = trainer.train_step([make_group(rng, [1.0, 1.0])])
    assert not metrics.trained and metrics.policy_version == 0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_push_weights_are_named_like_the_model(groups: list[RolloutGroup]) -> None:
    model = tiny_model()
    names = set(model.state_dict())
    trainer = GRPOTrainer(model, GRPOConfig(lr=1e-2))
    trainer.train_step(groups)
    pushed = trainer.state_dict_for_push()
    assert set(pushed) == names
    assert all(t.device.type == "cpu" for t in pushed.values())
    torch.testing.assert_close(pushed["model.norm.weight"], model.model.norm.weight.detach())


def test_misaligned_sample_is_rejected() -> None:
    with pytest.raises(ValueError, match="aligned with token_ids"):
        TrainSample(
            token_ids=[1, 2, 3],
            loss_mask=[0, 1],
            rollout_logprobs=[0, 0, 0],
            policy_versions=[-1, 0, 0],
            reward=1.0,
        )


def _turns_sample(reward: float, mask: list[int]) -> TrainSample:
    n = len(mask)
    return TrainSample(token_ids=list(range(1, n + 1)), loss_mask=mask, rollout_logprobs=[-1.0 * m for m in mask],
                       policy_versions=[0 if m else -1 for m in mask], reward=reward)


def test_the_batch_reports_advantages_and_the_prompt_length_of_every_turn() -> None:
    two_turns = [0, 0, 0, 1, 1, 0, 0, 1]  # turn prompts of 3 and 7 tokens
    signal = RolloutGroup(group_id="s", task="t", samples=[_turns_sample(1.0, two_turns), _turns_sample(0.0, two_turns)])
    equal = RolloutGroup(group_id="e", task="t", samples=[_turns_sample(0.5, [0, 1])] * 2)
    plan = prepare_batch([signal, equal], GRPOConfig())
    assert [round(a, 3) for a in plan.advantages] == [1.0, -1.0, 0.0, 0.0]
    assert plan.turn_prompt_tokens == [3, 7, 3, 7, 1, 1]
    trainer = GRPOTrainer(tiny_model(), GRPOConfig())
    metrics = trainer.train_step([signal, equal])
    assert (metrics.advantage_abs_mean, metrics.advantage_nonzero_frac) == pytest.approx((0.5, 0.5), abs=1e-5)
    assert (metrics.prompt_tokens_per_turn_mean, metrics.prompt_tokens_per_turn_max) == (22 / 6, 7)


def _tempered_logprobs(model: torch.nn.Module, sample: TrainSample, temperature: float) -> list[float]:
    """log mu(y_t | y_<t) of a policy server sampling at `temperature`: log_softmax(logits / T)."""
    ids = torch.tensor([sample.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float() / temperature, -1)
    return [0.0] + logp.gather(-1, ids[0, 1:, None])[:, 0].tolist()


@pytest.mark.parametrize("shared_prefix", [False, True])
def test_rollouts_sampled_at_a_temperature_are_trained_as_that_policy(groups: list[RolloutGroup],
                                                                      shared_prefix: bool) -> None:
    """Rollouts sampled at T = 0.5 by the very weights the learner holds: pi_theta must be the
    tempered policy, softmax(logits / T), or pi_old / mu is far from 1 on every token and the
    truncated importance weights bias each step. With the temperature the weights are exactly 1."""
    model = tiny_model()
    if shared_prefix:
        groups = [with_shared_prompt(group, list(range(20, 40))) for group in groups]
    sampled = [group.model_copy(update={"samples": [
        sample.model_copy(update={"rollout_logprobs": [lp if m else 0.0 for lp, m in zip(
            _tempered_logprobs(model, sample, 0.5), sample.loss_mask, strict=True)]})
        for sample in group.samples]}) for group in groups]
    tempered = GRPOTrainer(tiny_model(), GRPOConfig(temperature=0.5, micro_batch_tokens=64)).train_step(sampled)
    untempered = GRPOTrainer(tiny_model(), GRPOConfig(micro_batch_tokens=64)).train_step(sampled)
    assert tempered.mismatch == pytest.approx(1.0, abs=1e-4)
    assert tempered.is_weight_mean == pytest.approx(1.0, abs=1e-4) and tempered.is_frac_truncated == 0.0
    assert untempered.mismatch > 1.05  # the defect this guards: T = 1 in the learner, 0.5 in the sampler
