"""Batched next-token sampling with per-row temperature and top-p, returning the log-probability
of each sampled token under the processed distribution (the one actually sampled from)."""

from __future__ import annotations

import torch


@torch.no_grad()
def sample_next_tokens(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V]; temperature, top_p, uniforms [B] (uniforms in [0, 1), one draw per row from
    that row's own generator, so a row's sample does not depend on the rest of the batch).

    Processed distribution of a row:
        log q = log_softmax(logits / T)                       (T = temperature)
        keep  = smallest prefix of tokens sorted by q whose mass reaches top_p
        log p = log q - log(sum_{keep} q)   on keep, -inf elsewhere
    The token is drawn by inverse CDF: the first token whose cumulative p exceeds u.
    At T = 1, top_p = 1: log p = log_softmax(logits). Rows with T = 0 are greedy and report the
    raw log_softmax of the argmax (the T -> 0 distribution is a point mass).
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
    logq = torch.log_softmax(logits / scale, dim=-1)
    uniforms = uniforms.to(logits.device)

    if bool((top_p < 1).any()):
        sorted_logq, order = logq.sort(dim=-1, descending=True)
        sorted_q = sorted_logq.exp()
        cumulative = sorted_q.cumsum(dim=-1)
        # keep token i when the mass strictly before it is < top_p (the top token is always kept)
        keep = (cumulative - sorted_q) < top_p.unsqueeze(1)
        kept_cdf = (sorted_q * keep).cumsum(dim=-1)
        kept_mass = kept_cdf[:, -1:]
        position = torch.searchsorted(kept_cdf, uniforms.unsqueeze(1) * kept_mass, right=True)
        position = torch.minimum(position, keep.sum(dim=-1, keepdim=True) - 1)
        tokens = order.gather(1, position).squeeze(1)
        logprobs = (sorted_logq.gather(1, position) - kept_mass.log()).squeeze(1)
    else:
        cdf = logq.exp().cumsum(dim=-1)
        position = torch.searchsorted(cdf, uniforms.unsqueeze(1) * cdf[:, -1:], right=True)
        tokens = position.clamp_(max=logits.shape[-1] - 1).squeeze(1)
        logprobs = logq.gather(1, tokens.unsqueeze(1)).squeeze(1)

    if bool(greedy.any()):
        raw = torch.log_softmax(logits, dim=-1)
        greedy_tokens = raw.argmax(dim=-1)
        tokens = torch.where(greedy, greedy_tokens, tokens)
        logprobs = torch.where(
            greedy, raw.gather(1, greedy_tokens.unsqueeze(1)).squeeze(1), logprobs
        )
    return tokens, logprobs
