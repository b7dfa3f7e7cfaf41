"""Tiny real models and rollout groups shared by the learner tests."""

from __future__ import annotations

import random

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from learner.types import RewardStatus, RolloutGroup, TrainSample

VOCAB = 300
# StepMetrics fields measured, not computed: two runs of the same step differ in them.
MEASURED = {"peak_rss_gb", "peak_gpu_gb"}


def tiny_model(seed: int = 0) -> Qwen2ForCausalLM:
    """A 2-layer Qwen2 with hidden 32 and a 300-token vocabulary, random weights."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(config).float()


def make_sample(
    rng: random.Random,
    reward: float,
    *,
    prompt_len: int = 4,
    completion_len: int = 6,
    version: int = 0,
    status: RewardStatus = RewardStatus.SCORED,
    index: int = 0,
) -> TrainSample:
    n = prompt_len + completion_len
    mask = [0] * prompt_len + [1] * completion_len
    return TrainSample(
        token_ids=[rng.randrange(VOCAB) for _ in range(n)],
        loss_mask=mask,
        # Rollout logprobs near a uniform policy over the vocabulary, with some noise.
        rollout_logprobs=[-5.7 + rng.uniform(-0.5, 0.5) if m else 0.0 for m in mask],
        policy_versions=[version if m else -1 for m in mask],
        reward=reward,
        reward_status=status,
        sample_index=index,
    )


def make_group(
    rng: random.Random,
    rewards: list[float],
    *,
    group_id: str = "g",
    version: int = 0,
    statuses: list[RewardStatus] | None = None,
) -> RolloutGroup:
    statuses = statuses or [RewardStatus.SCORED] * len(rewards)
    return RolloutGroup(
        group_id=group_id,
        task="toy",
        samples=[
            make_sample(
                rng,
                r,
                completion_len=3 + rng.randrange(8),
                version=version,
                status=status,
                index=i,
            )
            for i, (r, status) in enumerate(zip(rewards, statuses))
        ],
    )


def with_shared_prompt(group: RolloutGroup, prompt: list[int]) -> RolloutGroup:
    """The group's samples, each starting with `prompt` (untrained) before its own tokens."""
    samples = [
        sample.model_copy(update={
            "token_ids": prompt + sample.token_ids,
            "loss_mask": [0] * len(prompt) + sample.loss_mask,
            "rollout_logprobs": [0.0] * len(prompt) + sample.rollout_logprobs,
            "policy_versions": [-1] * len(prompt) + sample.policy_versions,
        })
        for sample in group.samples
    ]
    return group.model_copy(update={"samples": samples})
