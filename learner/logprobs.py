"""log pi(y_t) and the entropy from logits, a chunk of positions at a time, under the
distribution each token was sampled from (sciproto/sampling.py): its temperature, then its top-k
and top-p truncation.

The vocabulary makes the logits the largest tensor of a training step ([B, T, V], V = 49152 for
SmolLM2: 0.2 MB per position in float32). Autograd through `log_softmax` keeps a float32 copy of
it for the backward pass, and the entropy and temperature add more: about four copies in all. Here the
forward pass keeps only the logits the model already holds; the float32 work runs over `chunk`
positions at a time, and the backward pass recomputes each chunk's softmax:

    z_t          = logits_t / T_t                               (float32, one chunk at a time)
    K_t          = the tokens top-k_t and top-p_t keep of z_t (sciproto/sampling_rule.py),
                   recomputed from the learner's own logits, and y_t itself; every token when
                   the position is not truncated
    log pi(y_t)  = z_t[y_t] - logsumexp_{K_t}(z_t)
    H_t          = -sum_{v in K_t} p_v log p_v = logsumexp_{K_t}(z_t) - sum_{v in K_t} p_v z_t,v
                   p = softmax(z_t over K_t)
    d log pi(y_t) / d logits_t = (onehot(y_t) - p) / T_t        (K_t held fixed: it is piecewise
                                                                 constant in the logits)

y_t joins K_t because it was sampled, so the sampler's own set held it; only a token within float
rounding of the set's edge can fall outside the learner's recomputed set, and it then counts in
the normaliser instead of making log pi -inf. The forward pass keeps each position's least kept
z_t (one float), from which the backward pass rebuilds K_t without sorting the vocabulary again.

Memory beyond the logits and their gradient, in float32 chunks of [chunk, V] (peak RSS measured on
the CPU over 2 x 1024 positions x V = 32768, forward and backward): about 2 untruncated, 3.5 with
top-k (the kept-token mask), 6.5 with top-p (its sort of the vocabulary holds the sorted values
and their int64 order beside the chunk).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from sciproto.sampling_rule import kept_tokens

__all__ = ["CHUNK_POSITIONS", "token_logprobs"]

# Positions (rows x time steps) per float32 chunk: 512 x 49152 x 4 bytes = 100 MB for SmolLM2.
CHUNK_POSITIONS = 512


def _spans(rows: int, length: int, chunk: int) -> Iterator[slice]:
    step = max(1, chunk // max(rows, 1))
    for start in range(0, length, step):
        yield slice(start, min(start + step, length))


def _tempered(logits: torch.Tensor, targets: torch.Tensor, span: slice, temperature: float | torch.Tensor,
              top_p: torch.Tensor | None, top_k: torch.Tensor | None, floor: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor | float, torch.Tensor | None]:
    """z = logits / T of a chunk of positions with what truncation drops set to -inf (the targets
    kept), T as it divides (a float or [B, c, 1]), and the kept-token mask (None: nothing dropped).

    The kept set of a position is every token whose z is at least `floor` (its least kept z; -inf
    where nothing is truncated): `floor` [B, S] is filled here from the rule (`kept_tokens`, a sort
    of the vocabulary) on the forward pass, and read back on the backward pass instead of sorting
    again. (A token tied with the least kept one counts as kept, where a sort could split the tie.)"""
    t = temperature[:, span].unsqueeze(-1) if isinstance(temperature, torch.Tensor) else temperature
    z = logits[:, span].float() / t
    if top_p is None or top_k is None or floor is None:
        return z, t, None
    least = floor[:, span]
    if not bool(torch.isfinite(least).any()):
        p, k = top_p[:, span], top_k[:, span]
        rule = None
        if bool((p < 1).any()) or bool((k > 0).any()):
            rule = kept_tokens(z.reshape(-1, z.shape[-1]), k.reshape(-1), p.reshape(-1).float())
        if rule is None:
            return z, t, None
        least = z.masked_fill(~rule.view_as(z), float("inf")).amin(dim=-1)
        floor[:, span] = least
    keep = (z >= least.unsqueeze(-1)).scatter_(-1, targets[:, span].unsqueeze(-1), True)
    return z.masked_fill_(~keep, float("-inf")), t, keep


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, temperature: float | torch.Tensor,
                chunk: int, top_p: torch.Tensor | None, top_k: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, length = targets.shape
        chosen = torch.empty(rows, length, dtype=torch.float32, device=logits.device)
        entropy = torch.empty_like(chosen)
        truncated = top_p is not None and top_k is not None
        floor = torch.full_like(chosen, float("-inf")) if truncated else None
        for span in _spans(rows, length, chunk):
            z, _, keep = _tempered(logits, targets, span, temperature, top_p, top_k, floor)
            lse = torch.logsumexp(z, dim=-1)
            chosen[:, span] = z.gather(-1, targets[:, span].unsqueeze(-1)).squeeze(-1) - lse
            finite = z if keep is None else z.masked_fill(~keep, 0.0)  # p_v z_v = 0 outside K
            entropy[:, span] = lse - (torch.softmax(z, dim=-1) * finite).sum(-1)
        tensors = [t for t in (temperature, top_p, top_k, floor) if isinstance(t, torch.Tensor)]
        ctx.save_for_backward(logits, targets, *tensors)
        ctx.scalar_temperature = None if isinstance(temperature, torch.Tensor) else temperature
        ctx.truncated = truncated
        ctx.chunk = chunk
        ctx.mark_non_differentiable(entropy)
        return chosen, entropy

    @staticmethod
    def backward(ctx: Any, grad_chosen: torch.Tensor | None, _grad_entropy: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, None, None, None, None, None]:
        logits, targets, *rest = ctx.saved_tensors
        if grad_chosen is None:
            return None, None, None, None, None, None
        temperature = ctx.scalar_temperature if ctx.scalar_temperature is not None else rest.pop(0)
        top_p, top_k, floor = rest if ctx.truncated else (None, None, None)
        grad = torch.empty_like(logits)
        rows, length = targets.shape
        grad[:, length:] = 0  # positions past the last target (the last one predicts nothing)
        for span in _spans(rows, length, ctx.chunk):
            g = grad_chosen[:, span].float().unsqueeze(-1)  # [B, c, 1]
            z, t, _ = _tempered(logits, targets, span, temperature, top_p, top_k, floor)
            grad_z = torch.softmax(z, dim=-1).mul_(-g)
            grad_z.scatter_add_(-1, targets[:, span].unsqueeze(-1), g)  # g (onehot(y) - p)
            grad[:, span] = grad_z.div_(t)
        return grad, None, None, None, None, None


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float | torch.Tensor = 1.0,
                   chunk: int = CHUNK_POSITIONS, top_p: torch.Tensor | None = None,
                   top_k: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(targets) and the entropy (detached), [B, S] float32 each, of targets [B, S] and
    logits [B, S', V] (any float dtype) whose first S positions predict them; differentiable in
    the logits. pi is softmax(logits / temperature) truncated by top_k and top_p (module
    docstring): temperature a float or [B, S] per position, top_p [B, S] (1: off) and top_k
    [B, S] long (0: off) both given or both None (no truncation). Positions past S (a model's
    last, which predicts no target) are ignored: passing the model's whole output, not a slice of
    it, keeps autograd from allocating a second gradient of the logits' size for the slice."""
    if logits.shape[0] != targets.shape[0] or logits.shape[1] < targets.shape[1]:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree: logits need"
                         " [B, S', V] with S' >= S for targets [B, S]")
    if (top_p is None) != (top_k is None):
        raise ValueError("give top_p and top_k together (1 and 0 where a position is not truncated)")
    for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k)):
        if isinstance(value, torch.Tensor) and value.shape != targets.shape:
            raise ValueError(f"{name} {tuple(value.shape)} must have the targets' shape {tuple(targets.shape)}")
    chosen, entropy = _TokenLogProbs.apply(logits, targets, temperature, chunk, top_p, top_k)
    return chosen, entropy
