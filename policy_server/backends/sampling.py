"""Batched next-token sampling with per-row temperature, top-k and top-p, returning the
log-probability of each sampled token under the processed distribution (the one actually sampled
from; the rule is `sciproto.sampling`'s, as vLLM applies it)."""

from __future__ import annotations

import torch

from sciproto.sampling_rule import kept_tokens


@torch.no_grad()
def sample_next_tokens(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor,
    top_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V]; temperature, top_p, uniforms [B] (uniforms in [0, 1), one draw per row from
    that row's own generator, so a row's sample does not depend on the rest of the batch); top_k
    [B] long (0: off), None for none.

    Processed distribution of a row (sciproto/sampling.py):
        z     = logits / T                                    (T = temperature)
        keep  = the top-k tokens of z (ties kept), then the top-p nucleus of what is left
        log p = log_softmax(z over keep)                      -inf elsewhere
    The token is drawn by inverse CDF: the first token whose cumulative p exceeds u.
    At T = 1, top_p = 1, top_k = 0: log p = log_softmax(logits). Rows with T = 0 are greedy and
    report the raw log_softmax of the argmax (the T -> 0 distribution is a point mass).
    Returns (tokens [B] int64, logprobs [B] float32).
    """
    logits = logits.float()
    greedy = temperature == 0
    # all rows greedy, the common evaluation case: three ops instead of the sampling path's dozen
    if bool(greedy.all()):
        raw = torch.log_softmax(logits, dim=-1)
        tokens = raw.argmax(dim=-1)
        return tokens, raw.gather(1, tokens.unsqueeze(1)).squeeze(1)
    scale = torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(1)
    z = logits / scale
    uniforms = uniforms.to(logits.device)
    if top_k is None:
        top_k = torch.zeros(z.shape[0], dtype=torch.long, device=z.device)
    keep = kept_tokens(z, top_k.to(z.device), top_p.to(z.device))
    if keep is not None:
        z = z.masked_fill(~keep, float("-inf"))
    logp = torch.log_softmax(z, dim=-1)
    probs = logp.exp()
    cdf = probs.cumsum(dim=-1)
    position = torch.searchsorted(cdf, uniforms.unsqueeze(1) * cdf[:, -1:], right=True)
    # float rounding may put u * total past the last cumulative value: take the last kept token
    vocab = torch.arange(z.shape[-1], device=z.device)
    last_kept = torch.where(probs > 0, vocab, 0).max(dim=-1, keepdim=True).values
    tokens = torch.minimum(position, last_kept).squeeze(1)
    logprobs = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)

    if bool(greedy.any()):
        raw = torch.log_softmax(logits, dim=-1)
        greedy_tokens = raw.argmax(dim=-1)
        tokens = torch.where(greedy, greedy_tokens, tokens)
        logprobs = torch.where(
            greedy, raw.gather(1, greedy_tokens.unsqueeze(1)).squeeze(1), logprobs
        )
    return tokens, logprobs
