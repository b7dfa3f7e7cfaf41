"""Mixed precision keeps fp32 master weights: bf16/fp8 are how the forward computes, never how the
weights and the optimizer state are stored."""

from __future__ import annotations

import pytest
import torch
from learner_fixtures import tiny_model

from learner.config import GRPOConfig
from learner.trainer import GRPOTrainer
from learner.types import RolloutGroup

# Over the 8-step curve below the fp32 loss falls from -0.50 to -1.33; the largest per-step
# difference measured was 5.4e-3 for bf16 and 8.1e-3 for fp8-emulated. The tolerance, about 3x
# that, leaves room for other CPUs' bf16 kernels and is still 3% of the curve's fall.
LOSS_CURVE_TOLERANCE = 0.025


def _step_changes(trainer: GRPOTrainer, groups: list[RolloutGroup]) -> tuple[float, float]:
    """After one step: the share of weights with a non-zero gradient that moved, and the largest
    move."""
    start = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train_step(groups)
    moved = considered = 0
    largest = 0.0
    for name, param in trainer.model.named_parameters():
        has_grad = param.grad is not None and param.grad != 0
        delta = (param.detach().float() - start[name].float()).abs()
        moved += int((delta[has_grad] > 0).sum())
        considered += int(has_grad.sum())
        largest = max(largest, float(delta.max()))
    return moved / max(considered, 1), largest


@pytest.mark.parametrize("precision", ["bf16", "fp8-emulated"])
def test_a_1e_6_step_moves_the_weights(groups: list[RolloutGroup], precision: str) -> None:
    """An lr of 1e-6 moves a weight of ~0.02 by ~1e-6 (Adam's first step is lr * sign(g)), far
    below bf16's spacing there (~1.2e-4): bf16 weights would not move at all."""
    trainer = GRPOTrainer(tiny_model(), GRPOConfig(precision=precision, lr=1e-6))
    share_moved, largest = _step_changes(trainer, groups)
    assert share_moved > 0.99
    assert largest <= 1.1e-6  # lr, plus fp32 rounding of the weight
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    for state in trainer.optimizer.state.values():
        assert state["exp_avg"].dtype == torch.float32
        assert state["exp_avg_sq"].dtype == torch.float32


def _loss_curve(groups: list[RolloutGroup], precision: str, steps: int = 8) -> list[float]:
    trainer = GRPOTrainer(tiny_model(), GRPOConfig(precision=precision, lr=1e-2))
    return [trainer.train_step(groups).loss for _ in range(steps)]


@pytest.mark.parametrize("precision", ["bf16", "fp8-emulated"])
def test_the_loss_curve_tracks_fp32(groups: list[RolloutGroup], precision: str) -> None:
    fp32 = _loss_curve(groups, "fp32")
    mixed = _loss_curve(groups, precision)
    assert fp32[-1] < fp32[0] - 0.5  # the curve moves, so tracking it means something
    assert mixed != fp32  # the low precision really computed: rounding leaves a trace
    for step, (a, b) in enumerate(zip(fp32, mixed)):
        assert abs(a - b) <= LOSS_CURVE_TOLERANCE, f"step {step}: fp32 {a:.5f} {precision} {b:.5f}"


def test_the_push_sends_the_served_dtype_and_keeps_tied_weights_shared(
    groups: list[RolloutGroup],
) -> None:
    trainer = GRPOTrainer(tiny_model(), GRPOConfig(precision="bf16", lr=1e-2), push_dtype=torch.bfloat16)
    trainer.train_step(groups)
    pushed = trainer.state_dict_for_push()
    assert {t.dtype for t in pushed.values()} == {torch.bfloat16}
    # Tied embeddings stay one tensor, so the push sends it once (as the server's manifest lists it).
    assert pushed["lm_head.weight"].data_ptr() == pushed["model.embed_tokens.weight"].data_ptr()
    masters = dict(trainer.model.named_parameters())
    torch.testing.assert_close(pushed["model.norm.weight"], masters["model.norm.weight"].detach().bfloat16())
    # The masters stay fp32: the push copies, it never casts the trained weights.
    assert masters["model.norm.weight"].dtype == torch.float32

    fp32_push = GRPOTrainer(tiny_model(), GRPOConfig(precision="bf16")).state_dict_for_push()
    assert {t.dtype for t in fp32_push.values()} == {torch.float32}
