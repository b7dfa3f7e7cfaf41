"""The kept-token set of top-k and top-p (sciproto/sampling.py states the rule), on tensors: what
the transformers backend samples from and what the learner trains under. It follows vLLM's
`apply_top_k_top_p_pytorch` (vllm/v1/sample/ops/topk_topp_sampler.py) step for step."""

from __future__ import annotations

import torch


def kept_tokens(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor | None:
    """The tokens each row keeps, [N, V] bool, of tempered logits z [N, V] (float32) under top_k
    [N] (long; 0 or >= V: all) and top_p [N] (1: all); None when no row truncates.

    top-k keeps every token whose z is at least the row's k-th largest (ties at the k-th are all
    kept); top-p then sorts the kept tokens ascending, takes softmax over them and drops each token
    whose cumulative probability is <= 1 - p, never the last (most likely) one.
    """
    vocab = z.shape[-1]
    use_k = (top_k > 0) & (top_k < vocab)
    use_p = top_p < 1
    if not bool(use_k.any()) and not bool(use_p.any()):
        return None
    keep = torch.ones_like(z, dtype=torch.bool)
    if bool(use_k.any()):
        k = torch.where(use_k, top_k, 1).long()
        kth = z.topk(int(k.max()), dim=-1).values.gather(-1, (k - 1).unsqueeze(-1))
        kth = kth.masked_fill(~use_k.unsqueeze(-1), float("-inf"))
        keep = z >= kth
    if bool(use_p.any()):
        masked = z.masked_fill(~keep, float("-inf"))
        ascending, order = masked.sort(dim=-1, descending=False)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - top_p).unsqueeze(-1)
        drop[:, -1] = False  # at least one
        drop &= use_p.unsqueeze(-1)
        keep = keep & ~torch.zeros_like(drop).scatter(-1, order, drop)
    return keep
