"""The tensors of a batch being decoded together: a left-padded KV cache, its attention mask and
each row's next position id. Rows can be dropped, repeated, and merged with a freshly prefilled
batch, so requests can leave and join between decode steps."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer


@dataclass
class DecodeBatch:
    cache: DynamicCache
    attention_mask: torch.Tensor  # [B, L] int64; 0 marks left padding
    positions: torch.Tensor  # [B] position id of the next token each row feeds

    @classmethod
    @torch.no_grad()
    def prefill(
        cls, model: PreTrainedModel, prompts: list[list[int]], pad_token_id: int
    ) -> tuple[DecodeBatch, torch.Tensor]:
        """Run the prompts (left-padded to a common length) and return the batch and the
        next-token logits [len(prompts), V]."""
        device = model.device
        length = max(len(prompt) for prompt in prompts)
        input_ids = torch.full((len(prompts), length), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), length), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, length - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, length - len(prompt) :] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        # position of a token = number of real tokens before it, so padding shifts nothing
        position_ids = (attention_mask.cumsum(-1) - 1).clamp_(min=0)
        cache = DynamicCache(config=model.config)
        _check_mergeable(cache)
        output = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
            **{_cache_argument(type(model)): cache},
        )
        positions = attention_mask.sum(-1)
        return cls(cache, attention_mask, positions), output.logits[:, -1, :]

    @torch.no_grad()
    def decode(self, model: PreTrainedModel, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row; return the next-token logits [B, V]."""
        ones = torch.ones_like(self.attention_mask[:, :1])
        self.attention_mask = torch.cat([self.attention_mask, ones], dim=1)
        output = model(
            input_ids=tokens.unsqueeze(1),
            attention_mask=self.attention_mask,
            position_ids=self.positions.unsqueeze(1),
            use_cache=True,
            **{_cache_argument(type(model)): self.cache},
        )
        self.positions = self.positions + 1
        return output.logits[:, -1, :]

    def select(self, rows: torch.Tensor) -> None:
        """Keep (or repeat) `rows`, then drop padding columns no remaining row needs."""
        rows = rows.to(self.attention_mask.device)
        self.cache.batch_select_indices(rows)
        self.attention_mask = self.attention_mask[rows]
        self.positions = self.positions[rows]
        first_used = int(self.attention_mask.any(dim=0).int().argmax())
        if first_used > 0:
            for layer in self.cache.layers:
                layer.keys = layer.keys[..., first_used:, :]
                layer.values = layer.values[..., first_used:, :]
            self.attention_mask = self.attention_mask[:, first_used:]

    def merge(self, other: DecodeBatch) -> None:
        """Append `other`'s rows; the shorter batch is left-padded to the longer one's length."""
        length = max(self.attention_mask.shape[1], other.attention_mask.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.keys = torch.cat([_pad_left(mine.keys, length), _pad_left(theirs.keys, length)])
            mine.values = torch.cat(
                [_pad_left(mine.values, length), _pad_left(theirs.values, length)]
            )
        self.attention_mask = torch.cat(
            [_pad_left(self.attention_mask, length), _pad_left(other.attention_mask, length)]
        )
        self.positions = torch.cat([self.positions, other.positions])


@functools.cache
def _cache_argument(model_class: type[PreTrainedModel]) -> str:
    """transformers renamed `past_key_values` to `cache`; use whichever this model class takes
    (looked up once per class: reading a signature costs more than a small model's decode step)."""
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _pad_left(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """Zero-pad the sequence dimension on the left: dim 1 of a mask [B, L], dim 2 of a cache
    tensor [B, heads, L, head_dim]."""
    if tensor.dim() == 2:
        return F.pad(tensor, (length - tensor.shape[1], 0))
    return F.pad(tensor, (0, 0, length - tensor.shape[2], 0))


def _check_mergeable(cache: DynamicCache) -> None:
    for layer in cache.layers:
        if type(layer) is not DynamicLayer or isinstance(layer, DynamicSlidingWindowLayer):
            raise ValueError(
                f"cache layer {type(layer).__name__} is not supported: the transformers backend "
                "needs full-attention models (Llama/Qwen2-style) whose cache it can re-pad"
            )
