"""The shared-prefix forward and the rows run without their padding: same logits, loss and gradient
as running every sequence in full."""

from __future__ import annotations

import random

import pytest
import torch
from learner_fixtures import VOCAB, make_group, make_sample, tiny_model, with_shared_prompt

from learner.config import GRPOConfig
from learner.grpo import TrainSequence, micro_batch_positions, pad_right, split_micro_batches
from learner.prefix import sequence_logprobs_and_entropy, shared_prefix_length, usable_shared_prefix
from learner.trainer import GRPOTrainer
from learner.types import RolloutGroup


def sequence(ids: list[int], group: int = -1) -> TrainSequence:
    return TrainSequence(token_ids=torch.tensor(ids), loss_mask=torch.ones(len(ids)),
                         rollout_logprobs=torch.zeros(len(ids)), advantage=0.0, group=group)


def test_shared_prefix_length() -> None:
    assert shared_prefix_length(pad_right([sequence([1, 2, 3, 4]), sequence([1, 2, 9, 4, 5])])) == 2
    # Bounded by the shortest row, and one position is always left to run batched.
    assert shared_prefix_length(pad_right([sequence([1, 2, 3]), sequence([1, 2, 3, 4, 5])])) == 3
    assert shared_prefix_length(pad_right([sequence([1, 2, 3]), sequence([1, 2, 3])])) == 2
    assert shared_prefix_length(pad_right([sequence([7, 2, 3]), sequence([1, 2, 3])])) == 0
    assert shared_prefix_length(pad_right([sequence([1, 2, 3])])) == 0


@pytest.fixture
def prompted_groups(rng: random.Random) -> list[RolloutGroup]:
    prompt = [rng.randrange(VOCAB) for _ in range(40)]
    return [with_shared_prompt(make_group(rng, [1.0, 0.0, 0.5, 0.0, 0.25], group_id=name), prompt)
            for name in ("a", "b")]


def test_logprobs_and_entropy_match_the_full_forward(prompted_groups: list[RolloutGroup]) -> None:
    model = tiny_model()
    batch = pad_right([sequence(s.token_ids) for group in prompted_groups for s in group.samples])
    assert shared_prefix_length(batch) == 40
    with torch.no_grad():
        full = sequence_logprobs_and_entropy(model, batch, shared=0)
        shared = sequence_logprobs_and_entropy(model, batch, shared=usable_shared_prefix(model, batch, 16))
    predicted = batch.attention_mask[:, 1:].bool()  # positions whose next token is not padding
    for name, full_values, shared_values in zip(("logprobs", "entropy"), full, shared, strict=True):
        assert shared_values.shape == full_values.shape, name
        torch.testing.assert_close(shared_values[predicted], full_values[predicted], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_a_training_step_has_the_same_loss_and_gradient(prompted_groups: list[RolloutGroup], kl_coef: float) -> None:
    trainers = {
        minimum: GRPOTrainer(tiny_model(), GRPOConfig(shared_prefix_min_tokens=minimum, kl_coef=kl_coef))
        for minimum in (0, 16)
    }
    metrics = {minimum: trainer.train_step(prompted_groups) for minimum, trainer in trainers.items()}
    assert metrics[16].loss == pytest.approx(metrics[0].loss, rel=1e-5, abs=1e-7)
    assert metrics[16].grad_norm == pytest.approx(metrics[0].grad_norm, rel=1e-4)
    full_grads = dict(trainers[0].model.named_parameters())
    for name, parameter in trainers[16].model.named_parameters():
        assert parameter.grad is not None, name
        torch.testing.assert_close(parameter.grad, full_grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def test_packing_counts_a_shared_prefix_once() -> None:
    """Eight 720-token samples of one 600-token prompt: 600 + 8 x 120 = 1,560 positions fit one
    micro-batch of 4,096; counted in full (8 x 720 = 5,760) they need two."""
    rng = random.Random(0)
    prompt = [rng.randrange(VOCAB) for _ in range(600)]
    group = [sequence(prompt + [rng.randrange(VOCAB) for _ in range(120)]) for _ in range(8)]
    assert [len(b) for b in split_micro_batches(group, 4096, min_shared_prefix=16)] == [8]
    assert [len(b) for b in split_micro_batches(group, 4096, min_shared_prefix=0)] == [5, 3]
    # A sequence of another prompt ends the shared run: it is counted in full again.
    other = sequence([rng.randrange(VOCAB) for _ in range(720)])
    assert [len(b) for b in split_micro_batches([*group, other], 4096, min_shared_prefix=16)] == [8, 1]


def test_packing_keeps_each_group_on_its_own_prompt_when_that_costs_fewer_positions() -> None:
    """Four groups of four 96-token samples, each group on its own 250-token prompt (a 50-token
    system prompt, then its question). In one micro-batch they share only the system prompt:
    50 + 16 x 296 positions. A micro-batch per group runs each prompt once: 4 x (250 + 4 x 96) =
    2,536 positions, the fewest; the packing must not cost more."""
    rng = random.Random(0)
    system = [rng.randrange(VOCAB) for _ in range(50)]
    groups = []
    for index in range(4):
        prompt = system + [rng.randrange(VOCAB) for _ in range(200)]
        groups.append([sequence(prompt + [rng.randrange(VOCAB) for _ in range(96)], index) for _ in range(4)])
    samples = [s for group in groups for s in group]
    packed = split_micro_batches(samples, 4096, min_shared_prefix=16)
    assert sum(micro_batch_positions(batch, 16) for batch in packed) <= 4 * (250 + 4 * 96), [len(b) for b in packed]
    assert [len(b) for b in packed] == [4, 4, 4, 4]
    # With the prefix not shared (min_shared_prefix 0) every position counts anyway: the budget alone packs.
    assert [len(b) for b in split_micro_batches(samples, 4096, min_shared_prefix=0)] == [11, 5]
    # Sequences of no group (demonstrations) still pack together up to the budget.
    singles = [sequence(system + [rng.randrange(VOCAB) for _ in range(n)]) for n in (300, 200, 250, 400)]
    assert [len(b) for b in split_micro_batches(singles, 4096, min_shared_prefix=16)] == [4]


def positions_run(model: torch.nn.Module) -> list[int]:
    """Token positions of each call of the model's decoder, recorded as the calls happen."""
    calls: list[int] = []
    model.model.register_forward_pre_hook(lambda _module, _args, kwargs: calls.append(kwargs["input_ids"].numel()),
                                          with_kwargs=True)
    return calls


def sampled(ids: list[int], prompt: int, top_p: float, top_k: int) -> TrainSequence:
    """A sample of `prompt` untrained tokens, then trained ones drawn at T 0.7 under top_p / top_k."""
    sampling = torch.tensor([[0.7, top_p, float(top_k)]]).repeat(len(ids), 1)
    return TrainSequence(token_ids=torch.tensor(ids), loss_mask=torch.tensor([0.0] * prompt + [1.0] * (len(ids) - prompt)),
                         rollout_logprobs=torch.zeros(len(ids)), advantage=0.0, sampling=sampling)


@pytest.mark.parametrize("truncated", [False, True], ids=["untruncated", "top-p-and-top-k"])
@pytest.mark.parametrize("min_shared", [0, 16], ids=["in-full", "shared-prompt"])
def test_rows_run_without_their_padding_give_the_padded_passs_logprobs(
        rng: random.Random, min_shared: int, truncated: bool) -> None:
    """Eight samples of one 40-token prompt with 3-30 tokens of their own: packed, the model runs
    only their real positions (the prompt once when it is shared) and every trained token gets
    the log-probability and entropy of the padded pass."""
    model = tiny_model()
    prompt = [rng.randrange(VOCAB) for _ in range(40)]
    lengths = [3, 30, 7, 12, 5, 21, 9, 4]
    top_p, top_k = (0.8, 50) if truncated else (1.0, 0)
    batch = pad_right([sampled(prompt + [rng.randrange(VOCAB) for _ in range(n)], 40, top_p, top_k) for n in lengths])
    shared = usable_shared_prefix(model, batch, min_shared)
    assert shared == (40 if min_shared else 0)
    calls = positions_run(model)
    with torch.no_grad():
        padded = sequence_logprobs_and_entropy(model, batch, shared)
        padded_calls = list(calls)
        calls.clear()
        packed = sequence_logprobs_and_entropy(model, batch, shared, packed=True)
    real = sum(lengths) + (40 if shared else 40 * len(lengths))
    assert sum(calls) == real < sum(padded_calls), (calls, padded_calls)
    trained = batch.loss_mask.bool()
    for name, want, got in zip(("logprobs", "entropy"), padded, packed, strict=True):
        assert got.shape == want.shape, name
        torch.testing.assert_close(got[trained], want[trained], rtol=1e-5, atol=1e-5, msg=name)


def head_positions(model: torch.nn.Module) -> list[int]:
    """Positions the model's output head scored, per call, recorded as the calls happen."""
    calls: list[int] = []
    model.get_output_embeddings().register_forward_hook(lambda _module, args, _output: calls.append(args[0].shape[:-1].numel()))
    return calls


@pytest.mark.parametrize("prompt_trained", [True, False], ids=["trained-prefix", "untrained-prompt"])
def test_the_prefix_keeps_its_logits_only_when_trained(rng: random.Random, prompt_trained: bool) -> None:
    """Rows that share trained tokens (a step group's earlier turns) still get their log-probability
    from the prefix's logits when the padding is skipped; an untrained prompt's head runs on its
    last position only (the one that predicts the first row token)."""
    model = tiny_model()
    shared_ids = [rng.randrange(VOCAB) for _ in range(30)]
    rows = [sampled(shared_ids + [rng.randrange(VOCAB) for _ in range(n)], 0 if prompt_trained else 30, 1.0, 0)
            for n in (2, 9, 4, 15)]
    batch = pad_right(rows)
    with torch.no_grad():
        padded = sequence_logprobs_and_entropy(model, batch, 30)
        heads = head_positions(model)
        packed = sequence_logprobs_and_entropy(model, batch, 30, packed=True)
    assert heads[0] == (30 if prompt_trained else 1)  # the prefix's pass comes first
    trained = batch.loss_mask.bool()
    assert bool(trained[:, :29].all()) == prompt_trained
    for want, got in zip(padded, packed, strict=True):
        torch.testing.assert_close(got[trained], want[trained], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
@pytest.mark.parametrize("min_shared", [0, 16], ids=["in-full", "shared-prompt"])
def test_a_training_step_without_padding_has_the_same_loss_and_gradient(
        rng: random.Random, kl_coef: float, min_shared: int) -> None:
    """Two groups on 40-token prompts, their samples 2-30 tokens long: the same step with the
    padding skipped runs fewer positions."""
    groups = []
    for name in ("a", "b"):
        prompt = [rng.randrange(VOCAB) for _ in range(40)]
        samples = [make_sample(rng, float(i % 3 == 0), completion_len=n, index=i)
                   for i, n in enumerate((2, 30, 6, 14, 3, 25))]
        groups.append(with_shared_prompt(RolloutGroup(group_id=name, task="toy", samples=samples), prompt))
    trainers = {
        skip: GRPOTrainer(tiny_model(), GRPOConfig(shared_prefix_min_tokens=min_shared, kl_coef=kl_coef, skip_padding=skip))
        for skip in (False, True)
    }
    calls = {skip: positions_run(trainer.model) for skip, trainer in trainers.items()}
    metrics = {skip: trainer.train_step(groups) for skip, trainer in trainers.items()}
    assert sum(calls[True]) < sum(calls[False])
    assert metrics[True].loss == pytest.approx(metrics[False].loss, rel=1e-5, abs=1e-7)
    assert metrics[True].grad_norm == pytest.approx(metrics[False].grad_norm, rel=1e-4)
    assert metrics[True].entropy == pytest.approx(metrics[False].entropy, rel=1e-5)
    padded_grads = dict(trainers[False].model.named_parameters())
    for name, parameter in trainers[True].model.named_parameters():
        assert parameter.grad is not None, name
        torch.testing.assert_close(parameter.grad, padded_grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)
