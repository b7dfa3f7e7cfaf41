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

Rows of different lengths are right-padded to the longest (MicroBatch), and a padded position costs
what a real one does. With `packed`, the rows after the prefix run as one row instead, each
attending to the prefix and causally to itself only, at its own positions:

    ids'        = ids[0, P:P+L_0] ++ ids[1, P:P+L_1] ++ ...        [1, S], S = sum_i L_i
    position'   = P + j for the j-th token of each row
    mask'[k,k'] = k' < P  or  (row(k) = row(k') and j(k') <= j(k))  (k' over the cache and ids')

so the logits of every real token are those of the padded pass, and the S + P positions replace
P + B (T - P); the log-probabilities go back to their [B, T-1] places, padding as 0. Positions
the loss does not train need no logits: when nothing in the prefix is trained (a group's prompt)
the prefix pass keeps only its last position's, which predicts each row's first suffix token.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from learner.grpo import MicroBatch, sampled_logprobs, token_logprobs_and_entropy, untruncated


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


# Pack the rows after the prefix when that saves at least this share of the padded positions: the
# packed row's attention spans every row's tokens (most of them masked), so a little padding is
# cheaper than the wider attention.
PACK_MIN_SAVING = 0.1


def _pack_worth_it(batch: MicroBatch, start: int) -> bool:
    rows, length = batch.input_ids.shape
    padded = rows * (length - start)
    real = int(batch.attention_mask.sum()) - rows * start
    return rows > 1 and padded - real >= PACK_MIN_SAVING * padded


def _packed_logprobs_and_entropy(model: nn.Module, batch: MicroBatch, start: int, cache: object | None,
                                 argument: str) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi and the entropy of the tokens each row's positions start.. predict, [B, T-start-1],
    with those positions of every row run as one packed row (module docstring) over `cache`, the
    prefix's key/value cache (None when start is 0)."""
    ids = batch.input_ids
    rows, length = ids.shape
    lengths = batch.attention_mask.sum(dim=1) - start  # [B] positions of each row from `start`
    row = torch.repeat_interleave(torch.arange(rows, device=ids.device), lengths)  # [S]
    first = torch.cumsum(lengths, 0) - lengths
    offset = torch.arange(row.numel(), device=ids.device) - first[row]  # j: place within its row
    position = start + offset
    own = (row[:, None] == row[None, :]) & (offset[None, :] <= offset[:, None])  # [S, S]
    allowed = torch.cat([own.new_ones(row.numel(), start), own], dim=1)  # True: attends (SDPA's bool mask)
    kwargs = {argument: cache, "use_cache": True} if cache is not None else {}
    logits = _logits_of(model(input_ids=ids[row, position][None], attention_mask=allowed[None, None],
                              position_ids=position[None], **kwargs))
    # Position p of a row predicts ids[p + 1]; a row's last position predicts padding (or nothing:
    # one pad column and one untruncated sampling row past the end keep the indices in range).
    targets = F.pad(ids, (0, 1))[row, position + 1]
    sampling = torch.cat([batch.sampling, untruncated(1, 1.0).to(batch.sampling).expand(rows, 1, 3)], dim=1)[row, position]
    chosen, entropy = sampled_logprobs(logits, targets[None], sampling[None])
    placed = []
    for values in (chosen, entropy):
        out = values.new_zeros(rows, length - start).index_put((row, offset), values[0])
        placed.append(out[:, :length - start - 1])
    return placed[0], placed[1]


def sequence_logprobs_and_entropy(
    model: nn.Module, batch: MicroBatch, shared: int, packed: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(y_t | y_<t) and the entropy for t >= 1, [B, T-1] each, as `token_logprobs_and_entropy`
    of the full forward under each token's sampling (`batch.sampling`); the first `shared` tokens
    (0: none, see `usable_shared_prefix`), common to every row, run once. `packed` (a transformers
    causal LM only): the rows' padding is not run where that saves enough (module docstring);
    positions not trained (`batch.loss_mask` 0) may then read 0."""
    ids = batch.input_ids
    sampling = batch.sampling
    # a custom 4D mask is SDPA's (a bool mask, True where a position attends); other attention
    # implementations run padded
    packed = packed and isinstance(model, PreTrainedModel) and model.config._attn_implementation == "sdpa"
    argument = _cache_argument(type(model))
    if shared == 0:
        if packed and _pack_worth_it(batch, 0):
            return _packed_logprobs_and_entropy(model, batch, 0, None, argument)
        logits = _logits_of(model(input_ids=ids, attention_mask=batch.attention_mask))
        return token_logprobs_and_entropy(logits, ids, sampling=sampling)
    rows = ids.shape[0]
    # The prefix's own tokens ids[1:P] are predicted by its logits; when none of them is trained
    # only the last position's logits are needed (it predicts ids[P]).
    head_trained = not packed or bool(batch.loss_mask[:, :shared - 1].any())
    prefix = model(input_ids=ids[:1, :shared], use_cache=True, **({} if head_trained else {"logits_to_keep": 1}))
    cache = prefix[argument]
    if head_trained:
        head = token_logprobs_and_entropy(prefix.logits, ids[:1, :shared], sampling=sampling[:1, :shared - 1])
    else:
        zeros = torch.zeros(1, shared - 1, device=ids.device)
        head = (zeros, zeros)
    # ids[P] from the prefix's last logits (one token per row)
    edge = token_logprobs_and_entropy(prefix.logits[:, -1:].expand(rows, -1, -1), ids[:, shared - 1:shared + 1],
                                      sampling=sampling[:, shared - 1:shared])
    if packed and _pack_worth_it(batch, shared):
        tail = _packed_logprobs_and_entropy(model, batch, shared, cache, argument)
    else:
        cache.batch_repeat_interleave(rows)
        # The mask covers cached and new positions; right padding keeps positions P.. for every row.
        suffix = model(input_ids=ids[:, shared:], attention_mask=batch.attention_mask, use_cache=True,
                       **{argument: cache}).logits
        tail = token_logprobs_and_entropy(suffix, ids[:, shared:], sampling=sampling[:, shared:])
    return tuple(  # type: ignore[return-value]
        torch.cat([h.expand(rows, -1), e, t], dim=1) for h, e, t in zip(head, edge, tail, strict=True))
