"""The training forward pass, with the prefix that every sequence of a micro-batch shares run once.

The samples of a GRPO group all extend one prompt (and groups often share a system prompt with
tool specs). Forwarding each sequence in full repeats the shared tokens' work B times. Here the
shared prefix of length P runs once (batch 1), its key/value cache is repeated over the B rows,
and only the suffixes run batched:

    logits[:, :P] = f(ids[0, :P])                         once, broadcast to the B rows
    logits[:, P:] = f(ids[:, P:] | KV(ids[0, :P]))        batched, attending to the cached prefix

Positions and causal attention are those of the full forward, so the logits are the same (up to
float rounding); gradients reach the prefix through both its logits and its cache. Cost per
micro-batch: P + B (T - P) token positions instead of B T.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn
from transformers import PreTrainedModel

from learner.grpo import MicroBatch, token_logprobs_and_entropy


def shared_prefix_length(batch: MicroBatch) -> int:
    """Length of the token prefix all rows share, within the shortest row and leaving at least
    one position to run batched; 0 for a single row. The prefix's tokens are predicted once, so
    the rows must also agree on the sampling each of them was drawn under."""
    ids = batch.input_ids
    if ids.shape[0] < 2:
        return 0
    shortest = int(batch.attention_mask.sum(dim=1).min())
    differs = (ids[:, :shortest] != ids[:1, :shortest]).any(dim=0).nonzero()
    length = int(differs[0]) if differs.numel() else shortest
    # position j of `sampling` predicts ids[:, j + 1]: a prefix of P tokens predicts j < P - 1
    sampled = (batch.sampling != batch.sampling[:1]).any(dim=-1).any(dim=0).nonzero()
    if sampled.numel():
        length = min(length, int(sampled[0]) + 1)
    return min(length, ids.shape[1] - 1)


def _logits_of(output: object) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output  # type: ignore[attr-defined,return-value]


@functools.cache
def _cache_argument(model_type: type[nn.Module]) -> str:
    """The forward argument that takes a key/value cache: `cache` from transformers 5.x on,
    `past_key_values` before (still accepted there, with a deprecation warning)."""
    return "cache" if "cache" in inspect.signature(model_type.forward).parameters else "past_key_values"


def usable_shared_prefix(model: nn.Module, batch: MicroBatch, min_shared_prefix: int) -> int:
    """The shared prefix length to run once: 0 unless it is at least `min_shared_prefix` tokens
    (0: never) and the model is a transformers causal LM (the key/value cache is its API)."""
    if min_shared_prefix <= 0 or not isinstance(model, PreTrainedModel):
        return 0
    shared = shared_prefix_length(batch)
    return shared if shared >= min_shared_prefix else 0


def sequence_logprobs_and_entropy(
    model: nn.Module, batch: MicroBatch, shared: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(y_t | y_<t) and the entropy for t >= 1, [B, T-1] each, as `token_logprobs_and_entropy`
    of the full forward under each token's sampling (`batch.sampling`); the first `shared` tokens
    (0: none, see `usable_shared_prefix`), common to every row, run once."""
    ids = batch.input_ids
    sampling = batch.sampling
    if shared == 0:
        logits = _logits_of(model(input_ids=ids, attention_mask=batch.attention_mask))
        return token_logprobs_and_entropy(logits, ids, sampling=sampling)
    rows = ids.shape[0]
    argument = _cache_argument(type(model))
    prefix = model(input_ids=ids[:1, :shared], use_cache=True)
    cache = prefix[argument]
    cache.batch_repeat_interleave(rows)
    # The mask covers cached and new positions; right padding keeps positions P.. for every row.
    suffix = model(input_ids=ids[:, shared:], attention_mask=batch.attention_mask, use_cache=True,
                   **{argument: cache}).logits
    # Three spans of predicted tokens, so the prefix's softmax over the vocabulary runs once:
    # ids[1:P] from the prefix logits (shared by all rows), ids[P] from the prefix's last logits
    # (one token per row), ids[P+1:] from the suffix logits.
    head = token_logprobs_and_entropy(prefix.logits, ids[:1, :shared], sampling=sampling[:1, :shared - 1])
    edge = token_logprobs_and_entropy(torch.cat([prefix.logits[:, -1:].expand(rows, -1, -1), suffix[:, :1]], dim=1),
                                      ids[:, shared - 1:shared + 1], sampling=sampling[:, shared - 1:shared])
    tail = token_logprobs_and_entropy(suffix, ids[:, shared:], sampling=sampling[:, shared:])
    return tuple(  # type: ignore[return-value]
        torch.cat([h.expand(rows, -1), e, t], dim=1) for h, e, t in zip(head, edge, tail, strict=True))
