"""A batch that fails part-way (after its first mini-batch's optimizer step) leaves the weights and
the optimizer state as they were before it: its groups are retried on the policy they were
sampled against, and a learner that saw the failure ends where one that never saw it does."""

from __future__ import annotations

import random

import pytest
import torch
from learner_fixtures import make_group, tiny_model

from learner.config import GRPOConfig
from learner.trainer import GRPOTrainer
from learner.types import RolloutGroup

CONFIG = GRPOConfig(lr=0.05, mini_batches=2, micro_batch_tokens=40)


class ForwardFault(RuntimeError):
    """The failure a forward pass raises (as an out-of-memory error would)."""


def _batches() -> list[list[RolloutGroup]]:
    rng = random.Random(7)
    return [
        [make_group(rng, [1.0, 0.0, 0.5, 0.0], group_id=f"{n}a"),
         make_group(rng, [0.2, 0.9, 0.9, 0.1], group_id=f"{n}b")]
        for n in range(2)
    ]


def _fail_forward(model: torch.nn.Module, call: int) -> torch.utils.hooks.RemovableHandle:
    """Make the model's `call`-th forward pass from now on raise ForwardFault."""
    calls = 0

    def hook(module: torch.nn.Module, args: object, kwargs: object) -> None:
        nonlocal calls
        calls += 1
        if calls == call:
            raise ForwardFault(f"forward pass {call} failed")

    return model.register_forward_pre_hook(hook, with_kwargs=True)


def _forward_passes(groups: list[RolloutGroup]) -> list[int]:
    """How many forward passes one train_step of `groups` makes, counted on a throw-away trainer:
    [pi_old passes, passes of mini-batch 1]."""
    trainer = GRPOTrainer(tiny_model(), CONFIG)
    calls: list[int] = []
    marks: list[int] = []
    trainer.model.register_forward_pre_hook(lambda m, a: calls.append(1))
    original = trainer.optimizer.step

    def step(*args: object, **kwargs: object) -> object:
        marks.append(len(calls))
        return original(*args, **kwargs)

    trainer.optimizer.step = step  # type: ignore[method-assign]
    trainer.train_step(groups)
    return marks


def _state(trainer: GRPOTrainer) -> dict[str, torch.Tensor]:
    """Every weight and every optimizer state tensor, by name."""
    names = {id(p): name for name, p in trainer.model.named_parameters()}
    state = {f"weight {name}": p.detach().clone() for name, p in trainer.model.named_parameters()}
    for param, entries in trainer.optimizer.state.items():
        for key, value in entries.items():
            state[f"adam {names[id(param)]} {key}"] = torch.as_tensor(value).clone()
    return state


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    differ = [name for name in want if not torch.equal(got[name], want[name])]
    assert not differ, f"{len(differ)} of {len(want)} tensors differ, e.g. {differ[:3]}"


def test_a_step_failing_after_its_first_mini_batch_leaves_weights_and_optimizer_as_before() -> None:
    first, second = _batches()
    # The fault strikes in the first forward pass after mini-batch 1's optimizer step.
    after_first_step = _forward_passes(second)[0] + 1
    assert len(_forward_passes(second)) == 2  # two optimizer steps: the fault lands between them

    failed = GRPOTrainer(tiny_model(), CONFIG)
    failed.train_step(first)
    handle = _fail_forward(failed.model, after_first_step)
    with pytest.raises(ForwardFault):
        failed.train_step(second)
    handle.remove()

    untouched = GRPOTrainer(tiny_model(), CONFIG)
    untouched.train_step(first)

    assert (failed.step, failed.policy_version) == (untouched.step, untouched.policy_version) == (1, 1)
    _assert_same(_state(failed), _state(untouched))

    # The retry trains the batch on the weights it was sampled against: same result as one try.
    retried, once = failed.train_step(second), untouched.train_step(second)
    assert retried.model_dump() == once.model_dump()
    _assert_same(_state(failed), _state(untouched))


def test_a_first_step_that_fails_leaves_no_optimizer_state() -> None:
    first, _ = _batches()
    failed = GRPOTrainer(tiny_model(), CONFIG)
    handle = _fail_forward(failed.model, _forward_passes(first)[0] + 1)
    with pytest.raises(ForwardFault):
        failed.train_step(first)
    handle.remove()
    _assert_same(_state(failed), _state(GRPOTrainer(tiny_model(), CONFIG)))
    assert failed.optimizer.state == {} or all(not s for s in failed.optimizer.state.values())
