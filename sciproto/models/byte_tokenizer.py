"""A byte-level tokenizer built in code: one token per byte, no merges, plus chat special tokens.

Any text round-trips exactly, nothing is downloaded, and the vocabulary is tiny (256 + 6), which
suits the small random models used on CPU.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from sciproto.models.chat_template import chatml_tool_template

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END, "<tool_call>", "</tool_call>", PAD]


def byte_to_unicode() -> dict[int, str]:
    """The ByteLevel (GPT-2) map from each byte to a printable character: printable Latin-1 bytes
    map to themselves, the other 68 to code points from 256 upwards, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    mapping = {byte: chr(byte) for byte in printable}
    extra = (byte for byte in range(256) if byte not in mapping)
    mapping.update({byte: chr(256 + offset) for offset, byte in enumerate(extra)})
    return mapping


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    # Token id == byte value: BPE with no merges over the 256 ByteLevel characters emits exactly
    # one token per byte; the special tokens follow as ids 256.. in SPECIAL_TOKENS order.
    vocab = {char: byte for byte, char in byte_to_unicode().items()}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=IM_END, pad_token=PAD, padding_side="left"
    )
    tokenizer.chat_template = chatml_tool_template()
    return tokenizer
