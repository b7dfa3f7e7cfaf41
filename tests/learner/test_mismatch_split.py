"""`mismatch` split in two: the engine mismatch (learner vs policy server on tokens sampled at the
learner's current version, where they should agree) and the staleness shift (tokens sampled by an
older version, where the policy has moved on by design)."""

from __future__ import annotations

import asyncio
import math
import random

import pytest
import torch
from learner_fixtures import make_group, tiny_model

from learner.config import GRPOConfig
from learner.trainer import GRPOTrainer
from learner.types import RolloutGroup, TrainSample
from policy_server.backends.transformers_backend import TransformersBackend
from policy_server.types import (
    ChatMessage,
    GenerationRequest,
    SampleResult,
    SamplingParams,
    VersionSpan,
)
from sciproto.models import load_model


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


def test_tokens_after_an_update_that_landed_mid_sample_are_not_counted_as_the_engines() -> None:
    """The transformers backend takes an update between two decode steps: a sample running across
    it goes on with the new weights over the KV cache the old ones computed (its prompt and tokens
    so far are not recomputed), so no single version sampled its later tokens. The learner at the
    new version must count them with the stale tokens, not in mismatch_engine, which stays the
    engine's own mismatch: 1 on the samples drawn whole by the new weights."""
    served = load_model("tiny", seed=0)
    backend = TransformersBackend(served, stream_interval=4)
    generator = torch.Generator().manual_seed(11)
    new = {s.name: torch.randn(s.shape, generator=generator) * 0.3 for s in backend.weight_manifest()}

    def request(text: str, seed: int) -> GenerationRequest:
        return GenerationRequest(messages=[ChatMessage("user", text)],
                                 sampling=SamplingParams(max_tokens=200, seed=seed, n=2))

    async def results() -> list[SampleResult]:
        streaming = asyncio.Event()  # a first delta came: the samples are running

        async def one(text: str, seed: int) -> list[SampleResult]:
            done = []
            async for event in backend.generate(request(text, seed)):
                if isinstance(event, SampleResult):
                    done.append(event)
                else:
                    streaming.set()
            return done
        running = [asyncio.create_task(one("q" * i, i)) for i in range(1, 5)]
        await asyncio.wait_for(streaming.wait(), timeout=60)
        await backend.update_weights(1, new)
        after = [asyncio.create_task(one("r" * i, 10 + i)) for i in range(1, 5)]
        done = [r for batch in await asyncio.gather(*running, *after) for r in batch]
        await backend.close()
        return done

    samples = asyncio.run(results())
    split = [r for r in samples if len(r.version_spans) == 2]
    assert split and any(r.version_spans == [VersionSpan(0, len(r.completion_token_ids), 1)] for r in samples)

    def train_sample(result: SampleResult, reward: float) -> TrainSample:
        prompt, completion = list(result.prompt_token_ids), list(result.completion_token_ids)
        versions = [-1] * len(prompt)
        for span in result.version_spans:
            versions += [span.version] * (span.end - span.start)
        return TrainSample(token_ids=prompt + completion, loss_mask=[0] * len(prompt) + [1] * len(completion),
                           rollout_logprobs=[0.0] * len(prompt) + list(result.logprobs), policy_versions=versions,
                           reward=reward)

    group = RolloutGroup(group_id="across-an-update", task="toy",
                         samples=[train_sample(r, float(i % 2)).model_copy(update={"sample_index": i})
                                  for i, r in enumerate(samples)])
    learner = load_model("tiny", seed=0).model.requires_grad_(True)  # (loaded to serve: no gradients)
    learner.load_state_dict(new, strict=False)
    trainer = GRPOTrainer(learner, GRPOConfig(micro_batch_tokens=4096))
    trainer.policy_version = 1
    metrics = trainer.train_step([group])
    assert metrics.mismatch_engine == pytest.approx(1.0, abs=1e-3), metrics.mismatch_engine
    assert metrics.staleness_shift is not None and metrics.stale_token_frac > 0
