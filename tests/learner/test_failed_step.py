"""A batch that fails part-way (after its first mini-batch's optimizer step) leaves the weights and
the optimizer state as they were before it: its groups are retried on the policy they were
sampled against, and a learner that saw the failure ends where one that never saw it does."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import test_fsdp2 as fsdp
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from learner_fixtures import MEASURED, make_group, tiny_model

from learner.config import GRPOConfig
from learner.distributed import broadcast_groups
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
    assert retried.model_dump(exclude=MEASURED) == once.model_dump(exclude=MEASURED)
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


def _failing_fsdp_worker(rank: int, rendezvous: str, out_dir: str) -> None:
    """Under FSDP2 (two ranks): batch 1 fails on both ranks as its second optimizer step begins,
    then is trained again."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=fsdp.WORLD_SIZE)
    try:
        trainer = GRPOTrainer(tiny_model(seed=0), fsdp.CONFIG)
        first, second = [broadcast_groups(b if rank == 0 else None) for b in fsdp._batches()]
        figures = [[m.loss, m.grad_norm] for m in [trainer.train_step(first)]]
        original, calls = trainer.optimizer.step, []

        def step(*args: object, **kwargs: object) -> object:
            calls.append(1)
            if len(calls) == 2:
                raise ForwardFault("the second optimizer step of the batch failed")
            return original(*args, **kwargs)

        trainer.optimizer.step = step  # type: ignore[method-assign]
        try:
            trainer.train_step(second)
            raise AssertionError("the injected fault did not fire")
        except ForwardFault:
            pass
        trainer.optimizer.step = original  # type: ignore[method-assign]
        figures += [[m.loss, m.grad_norm] for m in [trainer.train_step(second)]]
        weights = trainer.state_dict_for_push()
        if rank == 0:
            torch.save({"figures": figures, "weights": weights, "version": trainer.policy_version},
                       Path(out_dir) / "result.pt")
        dist.barrier()  # as in test_fsdp2: no rank tears down under the other's gloo work
    finally:
        dist.destroy_process_group()


def test_under_fsdp2_a_failed_step_restores_every_rank_shard(tmp_path: Path) -> None:
    rendezvous = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_failing_fsdp_worker, args=(rendezvous, str(tmp_path)), nprocs=fsdp.WORLD_SIZE, join=True)
    result = torch.load(tmp_path / "result.pt", weights_only=True)

    single = GRPOTrainer(tiny_model(seed=0), fsdp.CONFIG)
    expected = [[m.loss, m.grad_norm] for m in map(single.train_step, fsdp._batches())]
    assert result["version"] == 2
    torch.testing.assert_close(result["figures"], expected, rtol=1e-5, atol=1e-7)
    for name, value in single.state_dict_for_push().items():  # tolerances of test_fsdp2
        torch.testing.assert_close(result["weights"][name], value, rtol=1e-3, atol=2e-4)
