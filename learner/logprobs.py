"""log pi(y_t) and the entropy from logits, a chunk of positions at a time.

The vocabulary makes the logits the largest tensor of a training step ([B, T, V], V = 49152 for
SmolLM2: 0.2 MB per position in float32). Autograd through `log_softmax` keeps a float32 copy of
it for the backward pass, and the entropy and temperature add more: about four copies in all. Here the
forward pass keeps only the logits the model already holds; the float32 work runs over `chunk`
positions at a time, and the backward pass recomputes each chunk's softmax:

    z_t          = logits_t / T                                 (float32, one chunk at a time)
    log pi(y_t)  = z_t[y_t] - logsumexp(z_t)
    H_t          = -sum_v p_v log p_v = logsumexp(z_t) - sum_v p_v z_t,v     p = softmax(z_t)
    d log pi(y_t) / d logits_t = (onehot(y_t) - p) / T

Memory beyond the logits and their gradient: about three float32 chunks of [chunk, V].
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["CHUNK_POSITIONS", "token_logprobs"]

# Positions (rows x time steps) per float32 chunk: 512 x 49152 x 4 bytes = 100 MB for SmolLM2.
CHUNK_POSITIONS = 512


def _spans(rows: int, length: int, chunk: int) -> Iterator[slice]:
    step = max(1, chunk // max(rows, 1))
    for start in range(0, length, step):
        yield slice(start, min(start + step, length))


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows, length = targets.shape
        chosen = torch.empty(rows, length, dtype=torch.float32, device=logits.device)
        entropy = torch.empty_like(chosen)
        for span in _spans(rows, length, chunk):
            z = logits[:, span].float() / temperature
            lse = torch.logsumexp(z, dim=-1)
            chosen[:, span] = z.gather(-1, targets[:, span].unsqueeze(-1)).squeeze(-1) - lse
            entropy[:, span] = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
        ctx.save_for_backward(logits, targets)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(entropy)
        return chosen, entropy

    @staticmethod
    def backward(ctx: Any, grad_chosen: torch.Tensor | None, _grad_entropy: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, None, None, None]:
        logits, targets = ctx.saved_tensors
        if grad_chosen is None:
            return None, None, None, None
        grad = torch.empty_like(logits)
        rows, length = targets.shape
        grad[:, length:] = 0  # positions past the last target (the last one predicts nothing)
        for span in _spans(rows, length, ctx.chunk):
            g = grad_chosen[:, span].float().unsqueeze(-1)  # [B, c, 1]
            grad_z = torch.softmax(logits[:, span].float() / ctx.temperature, dim=-1).mul_(-g)
            grad_z.scatter_add_(-1, targets[:, span].unsqueeze(-1), g)  # g (onehot(y) - p)
            grad[:, span] = grad_z.div_(ctx.temperature)
        return grad, None, None, None


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   chunk: int = CHUNK_POSITIONS) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits / temperature)[targets] and the entropy (detached), [B, S] float32 each,
    of targets [B, S] and logits [B, S', V] (any float dtype) whose first S positions predict
    them; differentiable in the logits. Positions past S (a model's last, which predicts no
    target) are ignored: passing the model's whole output, not a slice of it, keeps autograd
    from allocating a second gradient of the logits' size for the slice."""
    if logits.shape[0] != targets.shape[0] or logits.shape[1] < targets.shape[1]:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree: logits need"
                         " [B, S', V] with S' >= S for targets [B, S]")
    chosen, entropy = _TokenLogProbs.apply(logits, targets, temperature, chunk)
    return chosen, entropy
