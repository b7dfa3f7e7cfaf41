"""FP8 training numerics (torchao float8, rowwise scales) emulated on CPU."""

from __future__ import annotations

import pytest
import torch
from learner_fixtures import tiny_model

from learner.config import GRPOConfig
from learner.fp8 import FP8UnavailableError, convert_to_fp8, count_fp8_linears
from learner.grpo import prepare_batch
from learner.trainer import GRPOTrainer
from learner.types import RolloutGroup


def _next_token_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
    )


def test_emulated_fp8_stays_close_to_fp32_and_trains() -> None:
    ids = torch.randint(0, 300, (4, 24), generator=torch.Generator().manual_seed(0))
    reference = tiny_model()
    fp8 = convert_to_fp8(tiny_model(), emulate=True)
    # Attention and MLP projections of both layers; the lm_head stays in high precision.
    assert count_fp8_linears(fp8) == 2 * 7
    assert type(fp8.lm_head) is torch.nn.Linear

    expected = _next_token_loss(reference, ids)
    loss = _next_token_loss(fp8, ids)
    assert torch.isfinite(loss)
    assert loss.item() != expected.item()  # the FP8 casts are really applied
    assert loss.item() == pytest.approx(expected.item(), rel=1e-2)

    loss.backward()
    grad = fp8.model.layers[0].mlp.down_proj.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_trainer_steps_in_emulated_fp8(groups: list[RolloutGroup]) -> None:
    model = tiny_model()
    names = set(model.state_dict())
    trainer = GRPOTrainer(model, GRPOConfig(precision="fp8-emulated", lr=1e-2))
    plan = prepare_batch(groups, trainer.config)
    assert plan.num_tokens > 0
    first = trainer.train_step(groups)
    second = trainer.train_step(groups)
    assert first.trained and torch.isfinite(torch.tensor([first.loss, second.loss])).all()
    assert first.grad_norm > 0
    assert set(trainer.state_dict_for_push()) == names


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on machines without CUDA")
def test_real_fp8_without_a_gpu_names_the_requirement() -> None:
    with pytest.raises(FP8UnavailableError, match="compute capability >= 8.9"):
        GRPOTrainer(tiny_model(), GRPOConfig(precision="fp8"))
