"""The learner trains each sample under the distribution that sampled it: the temperature, top-k
and top-p of each turn (its `sampling_spans`). Tokens drawn by the transformers backend's sampler
from a real tiny model, then trained by the learner with the same weights, give an importance
ratio pi_old / mu of 1 (`mismatch_engine`) whatever the truncation, and with samples of several
temperatures in one batch."""

from __future__ import annotations

import zlib

import pytest
import torch
from learner_fixtures import tiny_model

from learner.config import GRPOConfig
from learner.grpo import TrainSequence, pad_right
from learner.trainer import GRPOTrainer
from learner.types import RolloutGroup, TrainSample
from policy_server.backends.sampling import sample_next_tokens

PROMPT = [5, 17, 42, 8, 99, 3]
COMPLETION = 24


def _sample(model: torch.nn.Module, temperature: float, top_p: float, top_k: int,
            seed: int) -> tuple[list[int], list[float]]:
    """COMPLETION tokens after PROMPT, one full forward per token, drawn as the backend draws."""
    generator = torch.Generator().manual_seed(seed)
    ids, logprobs = list(PROMPT), []
    extra = {"top_k": torch.tensor([top_k])} if top_k else {}
    with torch.no_grad():
        for _ in range(COMPLETION):
            logits = model(input_ids=torch.tensor([ids])).logits[:, -1]
            token, logprob = sample_next_tokens(logits, torch.tensor([temperature]), torch.tensor([top_p]),
                                                torch.rand(1, generator=generator), **extra)
            ids.append(int(token))
            logprobs.append(float(logprob))
    return ids, logprobs


def _group(model: torch.nn.Module, name: str, settings: list[tuple[float, float, int]]) -> RolloutGroup:
    samples = []
    for index, (temperature, top_p, top_k) in enumerate(settings):
        ids, logprobs = _sample(model, temperature, top_p, top_k, seed=zlib.crc32(f"{name}/{index}".encode()) % 1000)
        prompt = len(PROMPT)
        samples.append(TrainSample(
            token_ids=ids, loss_mask=[0] * prompt + [1] * COMPLETION,
            rollout_logprobs=[0.0] * prompt + logprobs, policy_versions=[-1] * prompt + [0] * COMPLETION,
            reward=float(index % 2), sample_index=index,
            sampling_spans=[(prompt, prompt + COMPLETION, temperature, top_p, top_k)]))
    return RolloutGroup(group_id=name, task="t", samples=samples)


@pytest.mark.parametrize(("config_temperature", "settings"), [
    (1.0, [(1.0, 0.9, 0)] * 4),  # top-p
    (1.0, [(1.0, 1.0, 20)] * 4),  # top-k
    (0.8, [(0.8, 0.9, 40)] * 4),  # temperature, then top-k, then top-p
    (0.7, [(1.0, 1.0, 0), (0.7, 1.0, 0), (1.0, 0.95, 0), (0.7, 1.0, 30)]),  # per-sample sampling
], ids=["top_p", "top_k", "all_three", "per_sample"])
def test_the_learner_trains_the_distribution_that_sampled(
        config_temperature: float, settings: list[tuple[float, float, int]]) -> None:
    model = tiny_model(seed=3)
    groups = [_group(model, f"g{n}", settings) for n in range(2)]
    trainer = GRPOTrainer(model, GRPOConfig(temperature=config_temperature, mini_batches=1))
    metrics = trainer.train_step(groups)
    assert metrics.mismatch_engine is not None
    assert abs(metrics.mismatch_engine - 1) < 1e-3, metrics.mismatch_engine


def test_padding_reads_as_untruncated() -> None:
    """Rows of different lengths pad to one length; the padded positions train nothing and must not
    make an untruncated batch look truncated (which would run the top-k/top-p rule on every chunk)."""
    short = TrainSequence(token_ids=torch.tensor([1, 2]), loss_mask=torch.tensor([0.0, 1.0]),
                          rollout_logprobs=torch.zeros(2), advantage=1.0)
    long = TrainSequence(token_ids=torch.tensor([1, 2, 3, 4, 5]), loss_mask=torch.tensor([0.0, 1, 1, 1, 1]),
                         rollout_logprobs=torch.zeros(5), advantage=1.0)
    batch = pad_right([short, long], temperature=0.7)
    top_p, top_k = batch.sampling[..., 1], batch.sampling[..., 2]
    assert not bool(((top_p < 1) | (top_k > 0)).any()), batch.sampling
    assert batch.sampling[0, 1:].tolist() == [[1.0, 1.0, 0.0]] * 3  # padding: T = 1, untruncated
