"""The policy server's prompt tokenizing with the tiny model's real tokenizer and chat template: a
prompt that cannot fit is refused before it is tokenized, the bound never refuses one that fits,
and a long prompt is tokenized off the event loop while a short one is not."""

from __future__ import annotations

import asyncio
import functools
import threading

import pytest

from policy_server.tokenizing import PromptTooLong, Tokenizing, longest_token_chars
from sciproto.chat import ChatMessage, GenerationRequest
from sciproto.models import load_model
from sciproto.prompts import prompt_token_ids

LOADED = load_model("tiny")
MAX_CONTEXT = LOADED.max_context
LONGEST = longest_token_chars(LOADED.tokenizer)
tokenize = functools.partial(prompt_token_ids, LOADED.tokenizer, stop_token_ids=LOADED.stop_token_ids)


def ask(text: str) -> GenerationRequest:
    return GenerationRequest(messages=[ChatMessage(role="user", content=text)])


def test_the_bound_is_below_the_real_token_count() -> None:
    # No prompt that fits is refused: the bound from characters never passes the tokens counted.
    assert LONGEST
    for text in ("hi", "word " * 500, "ünïcödé ✓ " * 300, "x" * 5000):
        request = ask(text)
        tokens = len(tokenize(request))
        assert len(text) // (2 * LONGEST) <= tokens
        assert Tokenizing(tokenize, functools.partial(int, tokens + 1), LONGEST).check(request) >= len(text)


async def test_a_prompt_that_cannot_fit_is_refused_without_tokenizing() -> None:
    called: list[GenerationRequest] = []
    tokenizing = Tokenizing(lambda request: called.append(request) or tokenize(request), lambda: MAX_CONTEXT,
                            LONGEST)
    with pytest.raises(PromptTooLong) as refused:
        await tokenizing(ask("word " * (MAX_CONTEXT * LONGEST)))
    assert called == []
    assert refused.value.at_least >= MAX_CONTEXT and refused.value.chars == 5 * MAX_CONTEXT * LONGEST
    assert f"{MAX_CONTEXT} tokens" in str(refused.value) and "shorten the conversation" in str(refused.value)
    tokenizing.close()


async def test_a_long_prompt_is_tokenized_off_the_event_loop_and_a_short_one_in_place() -> None:
    loop_ran = threading.Event()
    threads: list[str] = []

    def waiting_for_the_loop(request: GenerationRequest) -> list[int]:
        threads.append(threading.current_thread().name)
        # On the loop's own thread this wait could not end: the loop sets it only while this runs.
        assert loop_ran.wait(timeout=30), "the event loop did not run while the long prompt was tokenized"
        return tokenize(request)

    tokenizing = Tokenizing(waiting_for_the_loop, lambda: MAX_CONTEXT, LONGEST, inline_chars=1000)
    try:
        long = asyncio.ensure_future(tokenizing(ask("word " * 400)))
        while not threads:
            await asyncio.sleep(0.01)
        loop_ran.set()
        assert await asyncio.wait_for(long, 60) == tokenize(ask("word " * 400))
        assert threads[0].startswith("tokenize")
        assert await tokenizing(ask("hi")) == tokenize(ask("hi"))
        assert threads[1] == threading.current_thread().name
    finally:
        tokenizing.close()
