"""DAPO's overlong filtering: samples with a policy turn cut by its token limit, counted always and
left untrained with `mask_truncated`."""

from __future__ import annotations

import random

import pytest
from learner_fixtures import make_group

from learner.config import GRPOConfig
from learner.grpo import prepare_batch
from learner.types import FinishReason, RolloutGroup, TrainSample

STOP, LENGTH = FinishReason.STOP, FinishReason.LENGTH


def _with_reasons(group: RolloutGroup, reasons: list[list[FinishReason]]) -> RolloutGroup:
    samples = [s.model_copy(update={"turn_finish_reasons": r}) for s, r in zip(group.samples, reasons, strict=True)]
    return group.model_copy(update={"samples": samples})


def test_a_sample_cut_by_its_token_limit_is_counted_and_masked_on_request(rng: random.Random) -> None:
    group = _with_reasons(make_group(rng, [1.0, 0.0, 0.5, 0.0]), [[STOP], [STOP, LENGTH], [STOP], []])
    kept = prepare_batch([group], GRPOConfig())
    masked = prepare_batch([group], GRPOConfig(mask_truncated=True))

    assert (kept.length_cut_samples, kept.truncated_masked_samples) == (1, 0)
    assert (masked.length_cut_samples, masked.truncated_masked_samples) == (1, 1)
    # The cut sample still counts in the group's statistics: the others keep their advantages.
    kept_advantages = [s.advantage for s in kept.sequences]
    assert [s.advantage for s in masked.sequences] == kept_advantages[:1] + kept_advantages[2:]
    assert masked.num_tokens == kept.num_tokens - group.samples[1].num_trained_tokens


def test_step_rewards_must_be_finite() -> None:
    with pytest.raises(ValueError, match="step_rewards must all be finite"):
        TrainSample(token_ids=[1, 2], loss_mask=[0, 1], rollout_logprobs=[0.0, -1.0], policy_versions=[-1, 0],
                    reward=1.0, step_rewards=[0.0, float("nan")])
