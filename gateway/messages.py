"""Anthropic's Messages API, `POST /v1/messages`, over the same sessions and token capture as the
OpenAI routes: a request becomes the chat request it stands for (so a session records it the same
way and a call extends the last one on the same tokens), and the answer is a Message, or its
stream of server-sent events.

Taken: `system` (a string or text blocks), `messages` whose content is a string or blocks of
`text`, `tool_use` (assistant) and `tool_result` (user), `tools` as {name, description,
input_schema}, `tool_choice` {"type": "auto"} or {"type": "none"}, `max_tokens`, `stop_sequences`,
`temperature`, `top_p`, `top_k`, `stream`, `metadata`; `service_tier` and `cache_control` are
accepted and change nothing (one tier, no prompt cache to steer). Refused with a 400 that names the field:
images and documents (the model reads text), `thinking` other than disabled, a `tool_choice` that
forces a tool (the policy samples freely), server tools. Errors have Anthropic's shape,
`{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from gateway.chat import ChatCall, Choice, parse_chat_request
from gateway.errors import ApiError, from_sciproto
from gateway.streaming import one_sample, open_event_stream
from sciproto.errors import SciprotoError
from sciproto.pb import policy_pb2

__all__ = ["anthropic_error", "message_object", "new_message_id", "parse_messages_request", "stream_message"]

_TAKEN = {"model", "max_tokens", "messages", "system", "tools", "tool_choice", "stop_sequences", "temperature",
          "top_p", "top_k", "stream", "metadata", "thinking", "service_tier", "cache_control"}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}


def _fail(message: str) -> ApiError:
    return ApiError(400, message)


def anthropic_error(error: ApiError) -> web.Response:
    """`error` in the Messages API's shape and status (Retry-After kept)."""
    kind = _ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return web.json_response({"type": "error", "error": {"type": kind, "message": error.message}},
                             status=error.status, headers=error.headers())


def _text_of(content: Any, where: str, *, allow: tuple[str, ...] = ("text",)) -> tuple[str, list[dict[str, Any]]]:
    """The text of a content string or list of blocks, and its blocks of the other allowed types."""
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise _fail(f"{where}.content must be a string or a list of content blocks")
    texts, others = [], []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise _fail(f"{where}.content[{i}].text must be a string")
            texts.append(block["text"])
        elif kind in allow:
            others.append({**block, "_where": f"{where}.content[{i}]"})
        elif kind in ("image", "document", "search_result"):
            raise _fail(f"{where}.content[{i}] is a {kind!r} block; this model reads text only")
        else:
            raise _fail(f"{where}.content[{i}] is a {kind!r} block; send text"
                        + (", tool_use and tool_result blocks" if len(allow) > 1 else " blocks"))
    return "\n".join(texts), others


def _tool_result_text(block: dict[str, Any]) -> str:
    content = block.get("content", "")
    if content is None:
        return ""
    text, _ = _text_of(content, block["_where"])
    return f"Error: {text}" if block.get("is_error") else text


def chat_body(body: Any) -> tuple[dict[str, Any], list[str]]:
    """The chat-completions body a Messages request stands for, and where each of its chat
    messages came from in the request (`system`, `messages[i]`), to name in errors."""
    if not isinstance(body, dict):
        raise _fail("the body must be a JSON object")
    unknown = sorted(set(body) - _TAKEN)
    if unknown:
        raise _fail(f"{unknown[0]}: this gateway does not take it; leave it out (it takes "
                    f"{', '.join(sorted(_TAKEN))})")
    thinking = body.get("thinking")
    if thinking is not None and not (isinstance(thinking, dict) and thinking.get("type") == "disabled"):
        raise _fail("thinking: the policy has no extended-thinking mode; leave it out or send {'type': 'disabled'}")
    if not isinstance(body.get("max_tokens"), int) or isinstance(body.get("max_tokens"), bool):
        raise _fail("max_tokens is required: the most tokens the reply may have (an integer >= 1)")
    messages: list[dict[str, Any]] = []
    sources: list[str] = []
    system = body.get("system")
    if system:
        text, _ = _text_of(system, "system") if not isinstance(system, str) else (system, [])
        messages.append({"role": "system", "content": text})
        sources.append("system")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise _fail("messages must be a non-empty list of {'role': 'user' | 'assistant', 'content'}")
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role == "user":
            text, results = _text_of(message.get("content"), where, allow=("text", "tool_result"))
            for block in results:  # tool results answer the previous turn's calls: they come first
                if not isinstance(block.get("tool_use_id"), str):
                    raise _fail(f"{block['_where']}.tool_use_id must be the id of the tool_use it answers")
                messages.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                                 "content": _tool_result_text(block)})
                sources.append(block["_where"])
            if text or not results:
                messages.append({"role": "user", "content": text})
                sources.append(where)
        elif role == "assistant":
            text, uses = _text_of(message.get("content"), where, allow=("text", "tool_use"))
            calls = []
            for block in uses:
                if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                    raise _fail(f"{block['_where']} must be {{'type': 'tool_use', 'id', 'name', 'input': object}}")
                calls.append({"id": str(block.get("id", "")), "type": "function",
                              "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
            messages.append({"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})})
            sources.append(where)
        else:
            raise _fail(f"{where}.role is {role!r}; use 'user' or 'assistant' (the system prompt goes in `system`)")
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise _fail("tools must be a list of {'name', 'description', 'input_schema'}")
    chat_tools = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") not in (None, "custom") or "input_schema" not in tool:
            raise _fail(f"tools[{i}] must be {{'name', 'description', 'input_schema'}}; server tools are not "
                        "supported")
        chat_tools.append({"type": "function", "function": {
            "name": tool.get("name"), "description": tool.get("description", ""), "parameters": tool["input_schema"]}})
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages, "tools": chat_tools,
                            "max_tokens": body["max_tokens"]}
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind not in ("auto", "none"):
            raise _fail(f"tool_choice {choice!r} is not supported: the policy samples freely; send {{'type': "
                        "'auto'}} or {'type': 'none'}")
        chat["tool_choice"] = kind
    for key in ("temperature", "top_p", "top_k", "stream"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    return chat, sources


_CHAT_NAMES = re.compile(r"\bmessages\[(\d+)\]|\bstop\b(?!_)")


def as_messages_error(error: ApiError, sources: list[str]) -> ApiError:
    """`error` in the Messages API's names: a chat message is the block or message it came from,
    `stop` is `stop_sequences`."""
    def one(match: re.Match[str]) -> str:
        if match.group(1) is not None:
            index = int(match.group(1))
            return sources[index] if index < len(sources) else "messages"
        return "stop_sequences"

    return ApiError(error.status, _CHAT_NAMES.sub(one, error.message), type_=error.type, param=error.param,
                    code=error.code, retry_after_s=error.retry_after_s)


def parse_messages_request(body: Any, max_context_tokens: int) -> ChatCall:
    chat, sources = chat_body(body)
    try:
        return parse_chat_request(chat, max_context_tokens)
    except ApiError as error:
        raise as_messages_error(error, sources) from None


def _stop_reason(choice: Choice) -> str:
    if choice.tool_calls and choice.sample.finish_reason == policy_pb2.FINISH_REASON_STOP:
        return "tool_use"
    if choice.sample.finish_reason == policy_pb2.FINISH_REASON_LENGTH:
        return "max_tokens"
    return "end_turn"


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(choice: Choice) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if choice.content or not choice.tool_calls:
        blocks.append({"type": "text", "text": choice.content})
    blocks += [{"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                "input": _input(call["function"]["arguments"])} for call in choice.tool_calls]
    return blocks


def message_object(message_id: str, model: str, choice: Choice, prompt_tokens: int) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": content_blocks(choice), "stop_reason": _stop_reason(choice), "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": len(choice.sample.completion_token_ids)}}


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


async def stream_message(request: web.Request, call: ChatCall, events: AsyncIterator[policy_pb2.GenerateResponse],
                         message_id: str, prompt_tokens: int, with_tools: bool
                         ) -> tuple[web.StreamResponse, policy_pb2.GenerateSample | None]:
    """The Messages API's events: message_start, a content block per text or tool_use (text
    deltas as they are sampled; with tools the text waits for the sample's end, when its tool-call
    markup has been parsed), message_delta with the stop reason and usage, message_stop."""
    response = await open_event_stream(request)

    async def send(kind: str, **payload: Any) -> None:
        await response.write(f"event: {kind}\ndata: {json.dumps({'type': kind, **payload})}\n\n".encode())

    text_open = False

    async def text_delta(text: str) -> None:
        nonlocal text_open
        if not text_open:
            text_open = True
            await send("content_block_start", index=0, content_block={"type": "text", "text": ""})
        await send("content_block_delta", index=0, delta={"type": "text_delta", "text": text})

    await send("message_start", message={
        "id": message_id, "type": "message", "role": "assistant", "model": call.model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}})
    try:
        sample = await one_sample(events, with_tools, text_delta)
    except SciprotoError as error:
        api = from_sciproto(error)
        await send("error", error={"type": _ERROR_TYPES.get(api.status, "api_error"), "message": api.message})
        sample = None
    if sample is None:
        await response.write_eof()
        return response, None
    choice = Choice(0, sample, with_tools)
    for index, block in enumerate(content_blocks(choice)):
        if block["type"] == "text":
            if not text_open:
                await send("content_block_start", index=index, content_block={"type": "text", "text": ""})
                if block["text"]:
                    await send("content_block_delta", index=index, delta={"type": "text_delta", "text": block["text"]})
            text_open = False
        else:
            await send("content_block_start", index=index, content_block={**block, "input": {}})
            await send("content_block_delta", index=index,
                       delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
        await send("content_block_stop", index=index)
    await send("message_delta", delta={"stop_reason": _stop_reason(choice), "stop_sequence": None},
               usage={"output_tokens": len(sample.completion_token_ids)})
    await send("message_stop")
    await response.write_eof()
    return response, sample
