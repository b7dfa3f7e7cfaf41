"""Every field of OpenAI's request bodies, sent with the official `openai` SDK to
`sciproto serve gateway` over a tiny policy server (each its own process): each field is honoured,
and its effect shows in the answer, or refused with a 400 naming it. No 200 drops a field.

The field lists are read from the installed SDK (`CompletionCreateParams`,
`ResponseCreateParams`), so a field a new SDK adds fails `test_every_sdk_field_has_a_case` until
it is given a case here (and an answer in the gateway)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat.completion_create_params import CompletionCreateParamsBase
from openai.types.responses.response_create_params import ResponseCreateParamsBase

from sciproto.processes import ServerProcess
from tests.gateway.conftest import running_gateway

MODEL = "fields-model"
QUESTION = [{"role": "user", "content": "Name three colours."}]
BASE: dict[str, Any] = {"model": MODEL, "messages": QUESTION, "seed": 7, "max_tokens": 12, "temperature": 1.0}
TOOL = {"type": "function", "function": {"name": "lookup", "description": "Look a word up.",
                                         "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}
# Sampling extensions vLLM's OpenAI server takes, which agents send through `extra_body`.
EXTENSIONS = {"top_k", "min_p", "repetition_penalty"}

Check = Callable[[openai.OpenAI], None]


@dataclass(frozen=True)
class Case:
    field: str
    value: Any
    check: Check | None = None  # None: refused with a 400 whose param names the field

    def __str__(self) -> str:
        return f"{self.field}={self.value!r}"[:60]


@pytest.fixture(scope="module")
def gateway(tiny_policy: ServerProcess) -> Iterator[ServerProcess]:
    with running_gateway("--policy", tiny_policy.target, "--model-name", MODEL) as server:
        yield server


# ------------------------------------------------------------------------------------------------
# Chat completions

def chat(client: openai.OpenAI, **fields: Any) -> Any:
    """A call with BASE's fields, overridden or added by `fields` (sent as they are)."""
    body = {**BASE, **fields}
    model, messages, stream = body.pop("model"), body.pop("messages"), body.pop("stream", False)
    return client.chat.completions.create(model=model, messages=messages, stream=stream, extra_body=body)


def text(reply: Any, index: int = 0) -> str:
    return reply.choices[index].message.content or ""


def same_as_plain(field: str, value: Any) -> Check:
    """The field is accepted and changes nothing sampled: the same seeded call without it gives
    the same tokens from the same prompt."""
    def check(client: openai.OpenAI) -> None:
        plain, with_field = chat(client, logprobs=True), chat(client, logprobs=True, **{field: value})
        assert with_field.usage.prompt_tokens == plain.usage.prompt_tokens
        assert [e.token for e in with_field.choices[0].logprobs.content] == \
            [e.token for e in plain.choices[0].logprobs.content]
    return check


def greedy_tokens(client: openai.OpenAI, **fields: Any) -> list[str]:
    reply = chat(client, logprobs=True, **fields)
    return [entry.token for entry in reply.choices[0].logprobs.content]


def check_messages(client: openai.OpenAI) -> None:
    short, longer = chat(client), chat(client, messages=[{"role": "system", "content": "Be brief."}, *QUESTION])
    assert longer.usage.prompt_tokens > short.usage.prompt_tokens and short.choices[0].message.role == "assistant"


def check_model(client: openai.OpenAI) -> None:
    assert chat(client).model == MODEL


def check_n(client: openai.OpenAI) -> None:
    reply = chat(client, n=3)
    assert [choice.index for choice in reply.choices] == [0, 1, 2]


def check_temperature(client: openai.OpenAI) -> None:
    # Greedy: other seeds, the same tokens; at 2.0 they differ (three samples of 12 random tokens).
    assert greedy_tokens(client, temperature=0, seed=1) == greedy_tokens(client, temperature=0, seed=2)
    hot = chat(client, temperature=2.0, n=3, logprobs=True)
    assert len({tuple(e.token for e in choice.logprobs.content) for choice in hot.choices}) > 1


def check_top_p(client: openai.OpenAI) -> None:
    # A nucleus of one token is greedy sampling whatever the seed.
    greedy = greedy_tokens(client, temperature=0)
    assert greedy_tokens(client, top_p=1e-9, seed=1) == greedy_tokens(client, top_p=1e-9, seed=2) == greedy


def check_top_k(client: openai.OpenAI) -> None:
    greedy = greedy_tokens(client, temperature=0)
    assert greedy_tokens(client, top_k=1, seed=1) == greedy_tokens(client, top_k=1, seed=2) == greedy


def check_max_tokens(field: str) -> Check:
    def check(client: openai.OpenAI) -> None:
        fields: dict[str, Any] = {"max_tokens": None, field: 2}
        reply = chat(client, temperature=2.0, **fields)
        assert 0 < reply.usage.completion_tokens <= 2
    return check


def check_stop(client: openai.OpenAI) -> None:
    whole = text(chat(client, temperature=0, max_tokens=16))
    # A printable character after the first (a random model also writes pieces of UTF-8
    # characters, which the text shows as U+FFFD until the character is complete).
    stop = next((c for c in whole[1:] if c.isascii() and c.isprintable()), None)
    assert stop is not None, f"the tiny model's greedy answer {whole!r} has nothing to stop at"
    cut = chat(client, temperature=0, max_tokens=16, stop=[stop])
    # OpenAI's behaviour, and the protocol's: the text ends before the stop string.
    assert text(cut) == whole[: whole.index(stop)] and cut.choices[0].finish_reason == "stop"


def check_seed(client: openai.OpenAI) -> None:
    assert greedy_tokens(client, seed=11) == greedy_tokens(client, seed=11)
    assert len({tuple(greedy_tokens(client, seed=seed, temperature=2.0)) for seed in (1, 2, 3)}) > 1


def check_logprobs(client: openai.OpenAI) -> None:
    reply = chat(client, logprobs=True)
    entries = reply.choices[0].logprobs.content
    assert len(entries) == reply.usage.completion_tokens and all(e.logprob <= 0 for e in entries)
    assert chat(client, logprobs=False).choices[0].logprobs is None


def check_top_logprobs_zero(client: openai.OpenAI) -> None:
    reply = chat(client, logprobs=True, top_logprobs=0)
    assert all(entry.top_logprobs == [] for entry in reply.choices[0].logprobs.content)


def check_stream(client: openai.OpenAI) -> None:
    whole = text(chat(client))
    pieces = [choice.delta.content or "" for chunk in chat(client, stream=True) for choice in chunk.choices]
    assert "".join(pieces) == whole


def check_stream_options(client: openai.OpenAI) -> None:
    chunks = list(chat(client, stream=True, stream_options={"include_usage": True, "include_obfuscation": False}))
    usage = [chunk.usage for chunk in chunks if chunk.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens > 0


def check_tools(client: openai.OpenAI) -> None:
    # The model sees the tools: the template renders them into the prompt.
    assert chat(client, tools=[TOOL]).usage.prompt_tokens > chat(client).usage.prompt_tokens


def check_tool_choice_none(client: openai.OpenAI) -> None:
    assert chat(client, tools=[TOOL], tool_choice="none").usage.prompt_tokens == chat(client).usage.prompt_tokens
    assert chat(client, tools=[TOOL], tool_choice="auto").usage.prompt_tokens > chat(client).usage.prompt_tokens


CHAT_CASES = [
    Case("messages", QUESTION, check_messages),
    Case("model", MODEL, check_model),
    Case("n", 3, check_n),
    Case("temperature", 0, check_temperature),
    Case("top_p", 1e-9, check_top_p),
    Case("max_tokens", 2, check_max_tokens("max_tokens")),
    Case("max_completion_tokens", 2, check_max_tokens("max_completion_tokens")),
    Case("stop", ["x"], check_stop),
    Case("seed", 11, check_seed),
    Case("logprobs", True, check_logprobs),
    Case("top_logprobs", 0, check_top_logprobs_zero),
    Case("top_logprobs", 5),
    Case("stream", True, check_stream),
    Case("stream_options", {"include_usage": True}, check_stream_options),
    Case("stream_options", {"include_usage": True, "chunk_size": 4}),
    Case("tools", [TOOL], check_tools),
    Case("tool_choice", "none", check_tool_choice_none),
    Case("tool_choice", "required"),
    Case("tool_choice", {"type": "function", "function": {"name": "lookup"}}),
    # Bookkeeping: who asks, how to cache. Accepted because they change nothing sampled.
    *(Case(field, value, same_as_plain(field, value)) for field, value in [
        ("user", "user-1"), ("safety_identifier", "hash-1"), ("prompt_cache_key", "key-1"),
        ("metadata", {"run": "r1"}), ("prompt_cache_options", {"mode": "implicit"}),
        ("prompt_cache_retention", "in_memory")]),
    Case("user", 42),
    # Fields the policy servers do not apply: their neutral value passes, any other is refused.
    *(Case(field, value, same_as_plain(field, value)) for field, value in [
        ("presence_penalty", 0), ("frequency_penalty", 0.0), ("logit_bias", {}),
        ("response_format", {"type": "text"}), ("parallel_tool_calls", True), ("modalities", ["text"]),
        ("store", False), ("service_tier", "auto"), ("min_p", 0), ("repetition_penalty", 1.0)]),
    *(Case(field, value) for field, value in [
        ("presence_penalty", 0.5), ("frequency_penalty", 1), ("logit_bias", {"42": 10}),
        ("response_format", {"type": "json_object"}), ("parallel_tool_calls", False),
        ("modalities", ["text", "audio"]), ("store", True), ("service_tier", "flex"), ("min_p", 0.1),
        ("repetition_penalty", 1.2), ("audio", {"voice": "alloy", "format": "wav"}),
        ("prediction", {"type": "content", "content": "Red, green, blue."}), ("reasoning_effort", "low"),
        ("verbosity", "low"), ("web_search_options", {}), ("moderation", {"model": "omni-moderation-latest"}),
        ("functions", [TOOL["function"]]), ("function_call", "auto"), ("frobnicate", 1)]),
    Case("top_k", 1, check_top_k),
    Case("top_k", 0.5),
]


def test_every_sdk_field_has_a_case() -> None:
    sdk = set(CompletionCreateParamsBase.__annotations__) | {"stream"}
    assert sdk - {case.field for case in CHAT_CASES} == set()
    assert EXTENSIONS <= {case.field for case in CHAT_CASES}


def honoured_or_refused(client: openai.OpenAI, case: Case, send: Callable[..., Any]) -> None:
    """The case's check passes, or `send` with the field is a 400 whose param and message name it."""
    if case.check is not None:
        case.check(client)
        return
    with pytest.raises(openai.BadRequestError) as caught:
        send(client, **{case.field: case.value})
    param = caught.value.param or ""
    assert param.split(".")[0] == case.field, caught.value.message
    assert case.field in caught.value.message


@pytest.mark.parametrize("case", CHAT_CASES, ids=str)
def test_chat_field_is_honoured_or_refused(client: openai.OpenAI, case: Case) -> None:
    honoured_or_refused(client, case, chat)


def test_a_session_records_the_sampling_each_call_was_drawn_with(gateway: ServerProcess) -> None:
    """Honoured sampling fields are trained under: the session records them with the call."""
    session = openai.OpenAI(base_url=f"http://{gateway.target}/s/fields-sampling/v1", api_key="unused",
                            max_retries=0, timeout=120)
    session.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, temperature=0.7,
                                    top_p=0.9, extra_body={"top_k": 5})
    calls = httpx.get(f"http://{gateway.target}/sessions/fields-sampling", timeout=30).json()["calls"]
    assert calls[0]["sampling"] == {"temperature": 0.7, "top_p": 0.9, "top_k": 5}


def test_legacy_function_call_in_a_message_is_refused(client: openai.OpenAI) -> None:
    history = [*QUESTION, {"role": "assistant", "content": None,
                           "function_call": {"name": "lookup", "arguments": "{}"}}, {"role": "user", "content": "?"}]
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, messages=history)
    assert caught.value.param == "messages[1].function_call" and "tool_calls" in caught.value.message


# ------------------------------------------------------------------------------------------------
# Responses

RESPONSE_BASE: dict[str, Any] = {"model": MODEL, "input": "Name three colours.", "max_output_tokens": 12,
                                 "temperature": 1.0, "seed": 7}


def respond(client: openai.OpenAI, **fields: Any) -> Any:
    body = {**RESPONSE_BASE, **fields}
    model, stream = body.pop("model"), body.pop("stream", False)
    return client.responses.create(model=model, stream=stream, extra_body=body)


def response_same_as_plain(field: str, value: Any) -> Check:
    def check(client: openai.OpenAI) -> None:
        plain, with_field = respond(client), respond(client, **{field: value})
        assert with_field.usage.input_tokens == plain.usage.input_tokens
        assert with_field.output_text == plain.output_text and with_field.usage.output_tokens == \
            plain.usage.output_tokens
    return check


def check_response_model(client: openai.OpenAI) -> None:
    assert respond(client).model == MODEL


def check_instructions(client: openai.OpenAI) -> None:
    assert respond(client, instructions="Be brief.").usage.input_tokens > respond(client).usage.input_tokens


def check_input(client: openai.OpenAI) -> None:
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Name three colours."}]}]
    assert respond(client, input=items).usage.input_tokens == respond(client).usage.input_tokens


def check_max_output_tokens(client: openai.OpenAI) -> None:
    reply = respond(client, max_output_tokens=2, temperature=2.0)
    assert 0 < reply.usage.output_tokens <= 2


def check_response_temperature(client: openai.OpenAI) -> None:
    assert respond(client, temperature=0, seed=1).output_text == respond(client, temperature=0, seed=2).output_text


def check_response_top_p(client: openai.OpenAI) -> None:
    greedy = respond(client, temperature=0).output_text
    assert respond(client, top_p=1e-9, seed=1).output_text == respond(client, top_p=1e-9, seed=2).output_text == greedy


def check_response_tools(client: openai.OpenAI) -> None:
    tool = {"type": "function", **TOOL["function"]}
    assert respond(client, tools=[tool]).usage.input_tokens > respond(client).usage.input_tokens
    assert respond(client, tools=[tool], tool_choice="none").usage.input_tokens == respond(client).usage.input_tokens


def check_response_stream(client: openai.OpenAI) -> None:
    whole = respond(client).output_text
    deltas = [event.delta for event in respond(client, stream=True) if event.type == "response.output_text.delta"]
    assert "".join(deltas) == whole


RESPONSE_CASES = [
    Case("model", MODEL, check_response_model),
    Case("input", "items", check_input),
    Case("instructions", "Be brief.", check_instructions),
    Case("max_output_tokens", 2, check_max_output_tokens),
    Case("temperature", 0, check_response_temperature),
    Case("top_p", 1e-9, check_response_top_p),
    Case("tools", "function", check_response_tools),
    Case("tool_choice", "none", check_response_tools),
    Case("tool_choice", "required"),
    Case("stream", True, check_response_stream),
    Case("top_logprobs", 0, response_same_as_plain("top_logprobs", 0)),
    Case("top_logprobs", 3),
    *(Case(field, value, response_same_as_plain(field, value)) for field, value in [
        ("user", "user-1"), ("safety_identifier", "hash-1"), ("prompt_cache_key", "key-1"),
        ("metadata", {"run": "r1"}), ("prompt_cache_options", {"mode": "implicit"}),
        ("prompt_cache_retention", "in_memory"), ("parallel_tool_calls", True), ("store", False),
        ("service_tier", "default"), ("truncation", "disabled"), ("background", False), ("include", []),
        ("text", {"format": {"type": "text"}}), ("stream_options", {"include_obfuscation": False})]),
    *(Case(field, value) for field, value in [
        ("parallel_tool_calls", False), ("store", True), ("service_tier", "priority"), ("truncation", "auto"),
        ("background", True), ("include", ["message.output_text.logprobs"]),
        ("text", {"format": {"type": "json_object"}}), ("reasoning", {"effort": "low"}), ("max_tool_calls", 2),
        ("previous_response_id", "resp_1"), ("conversation", "conv_1"), ("prompt", {"id": "pmpt_1"}),
        ("context_management", [{"type": "compaction"}]), ("moderation", {"model": "omni-moderation-latest"}),
        ("n", 2), ("frobnicate", 1), ("min_p", 0.1)]),
]


def test_every_responses_sdk_field_has_a_case() -> None:
    sdk = set(ResponseCreateParamsBase.__annotations__) | {"stream"}
    assert sdk - {case.field for case in RESPONSE_CASES} == set()


@pytest.mark.parametrize("case", RESPONSE_CASES, ids=str)
def test_responses_field_is_honoured_or_refused(client: openai.OpenAI, case: Case) -> None:
    honoured_or_refused(client, case, respond)
