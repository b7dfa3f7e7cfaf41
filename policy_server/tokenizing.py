"""Prompt tokenizing that no request can use to stall the others.

Two guards, both before a Generate's prompt reaches the model:

- **A length bound before tokenizing.** No token of the vocabulary stands for more characters than
  its longest entry (`longest_token_chars`), so a chat prompt of C characters has at least
  C / (2 * longest) tokens (the factor 2 leaves room for a normalizer that merges characters).
  A prompt whose bound already passes the model's context is refused as PROMPT_TOO_LONG without
  being rendered or tokenized: a 10 MB message costs a count of characters.
- **Off the event loop.** A prompt with more than `inline_chars` characters is tokenized on a
  small pool of threads (the Rust tokenizers release the GIL), at most `workers` at a time, so
  the server keeps streaming other requests' tokens while it works. Short prompts, nearly all of
  them, are tokenized in place: a thread hop would cost them more than the tokenizing.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from policy_server.types import GenerationRequest

__all__ = ["PromptTooLong", "Tokenizing", "longest_token_chars", "prompt_chars"]

# A normalizer may merge characters (NFC composes a letter and its accent); the bound divides by
# twice the longest token so it never refuses a prompt that would have fit.
NORMALIZER_ALLOWANCE = 2


class PromptTooLong(ValueError):
    """A prompt that cannot fit the context, known before tokenizing it."""

    def __init__(self, chars: int, at_least: int, max_context: int) -> None:
        super().__init__(f"the prompt has {chars} characters, so at least {at_least} tokens; the model's context "
                         f"holds {max_context} tokens of prompt and completion together: shorten the conversation")
        self.chars = chars
        self.at_least = at_least
        self.max_context = max_context


def longest_token_chars(tokenizer: Any) -> int | None:
    """The most characters one token of `tokenizer` stands for (its vocabulary's longest entry:
    a byte-level entry's characters are its bytes), or None when it has no vocabulary to read."""
    try:
        vocab = tokenizer.get_vocab()
    except (AttributeError, NotImplementedError):
        return None
    return max((len(token) for token in vocab), default=0) or None


def prompt_chars(request: GenerationRequest) -> int:
    """Characters of a chat request's messages and tools: its rendering has at least these."""
    chars = 0
    for message in request.messages or ():
        chars += len(message.content) + sum(len(call.name) + len(call.arguments) for call in message.tool_calls)
    if request.tools:
        chars += len(json.dumps(request.tools))
    return chars


class Tokenizing:
    """`tokenize` behind the length bound, off the event loop for long prompts."""

    def __init__(self, tokenize: Callable[[GenerationRequest], list[int]], max_context: Callable[[], int],
                 longest_token: int | None, *, workers: int = 2, inline_chars: int = 16384) -> None:
        self._tokenize = tokenize
        self._max_context = max_context
        self._longest = longest_token
        self._inline_chars = inline_chars
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenize")
        self._slots = asyncio.Semaphore(workers)

    def check(self, request: GenerationRequest) -> int:
        """The prompt's characters; PromptTooLong when they alone overflow the context."""
        if request.messages is None:
            return 0
        chars = prompt_chars(request)
        max_context = self._max_context()
        floor = len(request.previous_token_ids or ())
        if self._longest:
            floor = max(floor, chars // (NORMALIZER_ALLOWANCE * self._longest))
        if floor >= max_context:
            raise PromptTooLong(chars, floor, max_context)
        return chars

    async def __call__(self, request: GenerationRequest) -> list[int]:
        chars = self.check(request)
        if chars <= self._inline_chars:
            return self._tokenize(request)
        async with self._slots:  # a queue of long prompts waits here, not in the pool's threads
            return await asyncio.get_running_loop().run_in_executor(self._pool, self._tokenize, request)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
