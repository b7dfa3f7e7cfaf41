"""A small random-initialised Qwen2-style causal LM over the byte tokenizer: fast on CPU, and the
same seed always gives the same weights."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

from sciproto.models.byte_tokenizer import ENDOFTEXT, IM_END, build_byte_tokenizer

# Enough for the notebook env's first prompt (its instruction and tool specs: 2157 byte tokens)
# and a few steps of its state view.
TINY_MAX_CONTEXT = 4096


def build_tiny_model(seed: int, dtype: torch.dtype) -> PreTrainedModel:
    tokenizer = build_byte_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        # Heads of 32 dimensions: the smallest vLLM's CPU attention kernels take (32, 64, 80, ...).
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=TINY_MAX_CONTEXT,
        # Larger than the usual 0.02 so the random model's next-token distributions are peaked
        # rather than near-uniform, which makes sampling behaviour visible in tests.
        initializer_range=0.2,
        tie_word_embeddings=True,
        eos_token_id=[
            tokenizer.convert_tokens_to_ids(IM_END),
            tokenizer.convert_tokens_to_ids(ENDOFTEXT),
        ],
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    # Seed a private RNG stream so building a model leaves the global RNG untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    return model.to(dtype)
