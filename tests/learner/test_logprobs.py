"""log pi(y_t) and the entropy from logits: the chunked computation equals autograd through
log_softmax (values and gradients), and its memory stays near the logits' own size."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from learner.grpo import token_logprobs_and_entropy
from learner.logprobs import token_logprobs


def _reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    log_probs = torch.log_softmax(logits.double() / temperature, dim=-1)
    chosen = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return chosen, entropy.detach()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 5, 4096])  # one position, chunks that split rows unevenly, all at once
def test_values_and_gradients_match_log_softmax(temperature: float, chunk: int) -> None:
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 7, 11, generator=generator, dtype=torch.float64)).requires_grad_(True)
    targets = torch.randint(0, 11, (3, 7), generator=generator)
    weights = torch.randn(3, 7, generator=generator, dtype=torch.float64)

    chosen, entropy = token_logprobs(logits, targets, temperature, chunk)
    (grad,) = torch.autograd.grad((chosen * weights).sum(), logits)
    expected, expected_entropy = _reference(logits, targets, temperature)
    (expected_grad,) = torch.autograd.grad((expected * weights).sum(), logits)

    torch.testing.assert_close(chosen, expected.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, expected_entropy.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-6)
    assert not entropy.requires_grad


def test_bf16_logits_get_bf16_gradients_computed_in_float32() -> None:
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 4, 9, generator=generator).bfloat16().requires_grad_(True)
    targets = torch.randint(0, 9, (2, 4), generator=generator)
    chosen, _ = token_logprobs_and_entropy(torch.cat([logits, logits[:, :1]], dim=1), torch.cat(
        [targets[:, :1], targets], dim=1))
    chosen.sum().backward()
    expected, _ = _reference(logits.float(), targets, 1.0)
    assert chosen.dtype == torch.float32 and logits.grad is not None and logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(chosen, expected.float(), rtol=1e-5, atol=1e-5)


def test_shapes_that_disagree_are_refused() -> None:
    with pytest.raises(ValueError, match="disagree"):
        token_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="disagree"):
        token_logprobs(torch.zeros(3, 4, 5), torch.zeros(2, 4, dtype=torch.long))


def test_trailing_positions_are_ignored_and_get_zero_gradient() -> None:
    logits = torch.randn(2, 6, 5, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 5, (2, 4))
    chosen, _ = token_logprobs(logits, targets, 0.7, chunk=3)
    chosen.sum().backward()
    expected, _ = _reference(logits[:, :4], targets, 0.7)
    torch.testing.assert_close(chosen, expected.float(), rtol=1e-5, atol=1e-5)
    assert logits.grad is not None and logits.grad[:, 4:].abs().sum() == 0 and logits.grad[:, :4].abs().sum() > 0


MEASURE = textwrap.dedent("""
    import json, torch
    from learner.grpo import token_logprobs_and_entropy

    def peak_kb():
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))

    torch.manual_seed(0)
    logits = torch.randn(2, 1025, 32768).requires_grad_(True)  # 269 MB, a model's output
    ids = torch.randint(0, 32768, (2, 1025))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) restarts from the current RSS
    before = peak_kb()
    chosen, entropy = token_logprobs_and_entropy(logits, ids, temperature=0.7)
    chosen.sum().backward()
    print(json.dumps({"logits_mb": logits.numel() * 4 / 1e6, "extra_mb": (peak_kb() - before) / 1e3}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak RSS from /proc")
def test_forward_and_backward_hold_little_beyond_the_logits_and_their_gradient() -> None:
    # In a fresh process, so that the peak RSS is this computation's. The gradient of the logits
    # is one copy of their size; everything else must stay well below another.
    result = subprocess.run([sys.executable, "-c", MEASURE], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["extra_mb"] < 1.6 * measured["logits_mb"], measured


@pytest.mark.parametrize("chunk", [1, 4096])
def test_truncated_values_and_gradients_match_masked_log_softmax(chunk: int) -> None:
    """Per-position temperature, top-p and top-k: log pi is the log-softmax over the kept tokens
    (sciproto.sampling_rule) and its gradient autograd's through that masked log-softmax."""
    from sciproto.sampling_rule import kept_tokens

    generator = torch.Generator().manual_seed(2)
    logits = (3 * torch.randn(2, 6, 40, generator=generator, dtype=torch.float64)).requires_grad_(True)
    targets = logits.detach().argsort(dim=-1, descending=True)[..., 1]  # the second likeliest
    temperature = torch.tensor([[1.0, 0.7, 0.7, 1.3, 1.0, 0.5]] * 2)
    top_p = torch.tensor([[1.0, 0.9, 1.0, 0.6, 0.95, 1.0], [0.8] * 6])
    top_k = torch.tensor([[0, 0, 5, 10, 3, 0], [0, 2, 0, 4, 0, 39]])
    weights = torch.randn(2, 6, generator=generator, dtype=torch.float64)

    chosen, entropy = token_logprobs(logits, targets, temperature, chunk, top_p=top_p, top_k=top_k)
    (grad,) = torch.autograd.grad((chosen * weights).sum(), logits)

    z = logits / temperature.double().unsqueeze(-1)
    keep = kept_tokens(z.detach().float().reshape(-1, 40), top_k.reshape(-1), top_p.reshape(-1)).view(2, 6, 40)
    dropped = ~keep.gather(-1, targets.unsqueeze(-1))
    keep = keep.scatter(-1, targets.unsqueeze(-1), True)  # the sampled token counts, even at the set's edge
    log_p = torch.log_softmax(z.masked_fill(~keep, float("-inf")), dim=-1)
    expected = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (expected_grad,) = torch.autograd.grad((expected * weights).sum(), logits)
    expected_entropy = -(log_p.exp() * log_p.masked_fill(~keep, 0.0)).sum(-1)

    assert bool((~keep).any()) and bool(dropped.any())  # truncation, and a target the rule alone drops
    torch.testing.assert_close(chosen, expected.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, expected_entropy.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-6)
