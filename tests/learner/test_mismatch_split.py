"""`mismatch` split in two: the engine mismatch (learner vs policy server on tokens sampled at the
learner's current version, where they should agree) and the staleness shift (tokens sampled by an
older version, where the policy has moved on by design)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from learner_fixtures import make_group, tiny_model

from learner.config import GRPOConfig
from learner.trainer import GRPOTrainer
from learner.types import RolloutGroup, TrainSample


def _sampled_by(model: torch.nn.Module, sample: TrainSample, version: int, shift: float) -> TrainSample:
    """`sample` as a policy server serving `version` would report it: the learner's own logprobs
    of its trained tokens, moved by `shift` nats."""
    ids = torch.tensor([sample.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    exact = [0.0] + logp.gather(-1, ids[0, 1:, None])[:, 0].tolist()
    return sample.model_copy(update={
        "rollout_logprobs": [lp + shift if m else 0.0 for lp, m in zip(exact, sample.loss_mask)],
        "policy_versions": [version if m else -1 for m in sample.loss_mask],
    })


def _group(model: torch.nn.Module, rng: random.Random, name: str, version: int, shift: float) -> RolloutGroup:
    group = make_group(rng, [1.0, 0.0, 0.5, 0.0], group_id=name)
    return group.model_copy(update={"samples": [_sampled_by(model, s, version, shift) for s in group.samples]})


@pytest.mark.parametrize("mini_batches", [1, 2])
def test_mismatch_splits_into_engine_mismatch_and_staleness_shift(mini_batches: int) -> None:
    model, rng = tiny_model(), random.Random(3)
    current = _group(model, rng, "current", version=4, shift=0.05)  # an engine 0.05 nats off
    stale = _group(model, rng, "stale", version=3, shift=0.4)  # sampled before the last update
    trainer = GRPOTrainer(tiny_model(), GRPOConfig(mini_batches=mini_batches, micro_batch_tokens=64))
    trainer.policy_version = 4
    metrics = trainer.train_step([current, stale])

    current_tokens = sum(s.num_trained_tokens for s in current.samples)
    stale_tokens = sum(s.num_trained_tokens for s in stale.samples)
    assert metrics.mismatch_engine == pytest.approx(math.exp(0.05), rel=1e-4)
    assert metrics.staleness_shift == pytest.approx(math.exp(0.4), rel=1e-4)
    assert metrics.stale_token_frac == pytest.approx(stale_tokens / (current_tokens + stale_tokens))
    # `mismatch` stays the mean over every token: the two parts weighted by their tokens.
    both = (current_tokens * math.exp(0.05) + stale_tokens * math.exp(0.4)) / (current_tokens + stale_tokens)
    assert metrics.mismatch == pytest.approx(both, rel=1e-4)


def test_a_batch_of_one_kind_reports_no_figure_for_the_other() -> None:
    model, rng = tiny_model(), random.Random(4)
    trainer = GRPOTrainer(tiny_model(), GRPOConfig(micro_batch_tokens=64))
    metrics = trainer.train_step([_group(model, rng, "only", version=0, shift=0.0)])
    assert metrics.mismatch_engine == pytest.approx(1.0, abs=1e-4)
    assert metrics.staleness_shift is None and metrics.stale_token_frac == 0.0
    assert "staleness_shift" in metrics.model_dump()  # logged as null, not left out
