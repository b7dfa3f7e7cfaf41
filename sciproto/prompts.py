"""Prompt token ids for a GenerationRequest, including multi-turn continuation that extends the
previous turn's exact ids instead of re-tokenizing them."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from transformers import PreTrainedTokenizerBase

from sciproto.chat import ChatMessage, GenerationRequest


def prompt_token_ids(
    tokenizer: PreTrainedTokenizerBase, request: GenerationRequest, stop_token_ids: Collection[int]
) -> list[int]:
    if request.prompt_token_ids is not None:
        _check_ids(request.prompt_token_ids, len(tokenizer))
        return list(request.prompt_token_ids)
    assert request.messages is not None  # GenerationRequest guarantees one of the two
    tools = [openai_function_tool(tool) for tool in request.tools]
    full = render_chat(tokenizer, request.messages, tools, add_generation_prompt=True)
    if request.previous_token_ids is None:
        return tokenizer.encode(full, add_special_tokens=False)
    _check_ids(request.previous_token_ids, len(tokenizer))
    suffix = _text_after_previous_turn(
        tokenizer,
        request.messages,
        tools,
        full,
        stop_token_ids,
        request.previous_token_ids[-1] in stop_token_ids,
    )
    return list(request.previous_token_ids) + tokenizer.encode(suffix, add_special_tokens=False)


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[ChatMessage],
    tools: list[dict[str, Any]],
    add_generation_prompt: bool,
) -> str:
    return tokenizer.apply_chat_template(
        [message.to_template_dict() for message in messages],
        tools=tools or None,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
    )


def openai_function_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """`{"type": "function", "function": {...}}`, accepting the bare function schema too."""
    if tool.get("type") == "function" and isinstance(tool.get("function"), dict):
        function = tool["function"]
    elif isinstance(tool.get("name"), str):
        function = tool
    else:
        raise ValueError(
            'a tool must be {"type": "function", "function": {"name": ..., "parameters": ...}} '
            f"or the bare function schema; got keys {sorted(tool)}"
        )
    if not isinstance(function.get("name"), str):
        raise ValueError(f"tool function has no string name: {function!r}")  # noqa: TRY004 -- bad request content
    return {"type": "function", "function": function}


def _text_after_previous_turn(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[ChatMessage],
    tools: list[dict[str, Any]],
    full: str,
    stop_token_ids: Collection[int],
    previous_ended_with_stop_token: bool,
) -> str:
    """The rendered text that follows the previous turn's last sampled token.

    The previous turn ends with the last assistant message. Its rendering ends with the stop
    token that closed the sample (e.g. "<|im_end|>") and whatever the template writes after it
    ("\\n"). The previous ids end at that stop token, or before it when the sample was cut off.
    """
    last_assistant = max(
        (i for i, message in enumerate(messages) if message.role == "assistant"), default=None
    )
    if last_assistant is None:
        raise ValueError("previous_token_ids given but messages hold no assistant turn to extend")
    history = render_chat(
        tokenizer, messages[: last_assistant + 1], tools, add_generation_prompt=False
    )
    if not full.startswith(history):
        raise ValueError(
            "the chat template does not render the conversation up to the last assistant message "
            "as a prefix of the whole conversation; send prompt_token_ids instead"
        )
    stop_texts = [tokenizer.decode([token_id]) for token_id in stop_token_ids]
    end, stop_text = max((history.rfind(text), text) for text in stop_texts)
    if end < 0:
        raise ValueError("the rendered assistant turn does not end with a stop token")
    if previous_ended_with_stop_token:
        end += len(stop_text)
    return history[end:] + full[len(history) :]


def _check_ids(ids: list[int], vocab_size: int) -> None:
    bad = next((token for token in ids if not 0 <= token < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
