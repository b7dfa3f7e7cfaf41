"""The subset of `POST /v1/responses` that agent frameworks use: `input` as a string or items
(messages, `function_call`, `function_call_output`), `instructions`, function `tools`,
`max_output_tokens`, `temperature`, `top_p`, streaming events. A request becomes the chat request
it stands for, so sessions record it the same way; the agent sends its whole input each turn
(`previous_response_id` and stored responses are not kept)."""

from __future__ import annotations

import re
import uuid
from typing import Any

from gateway.chat import ChatCall, Choice, is_neutral, parse_chat_request
from gateway.errors import ApiError

__all__ = ["KNOWN", "as_responses_error", "chat_body", "output_items", "parse_responses_request", "response_object"]

# Every top-level field of a Responses body (the `openai` SDK's ResponseCreateParams) is passed to
# the chat-completions checks under the same name (which honour, accept or refuse it as
# gateway.chat says), translated here, or refused unless neutral; any other key is refused with
# a 400 naming it. seed, top_k, min_p and repetition_penalty are extensions, as in chat.
_PASSED = ("model", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "stream", "stream_options",
           "seed", "top_logprobs", "user", "safety_identifier", "prompt_cache_key", "metadata",
           "prompt_cache_options", "prompt_cache_retention", "parallel_tool_calls", "service_tier", "moderation")
_TRANSLATED = ("input", "instructions", "tools", "tool_choice", "max_output_tokens", "text", "store",
               "previous_response_id", "conversation")
# Refused unless null or the value given: each asks for something this gateway does not do.
_NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "truncation": (("disabled",), ("this gateway never drops input items: a too-long input is refused with "
                                  "context_length_exceeded; send 'disabled' or leave it out")),
    "background": ((False,), "responses run in the foreground only; leave it out"),
    "include": (([],), ("no extra output data is available (the sampled tokens are recorded in the session); "
                       "leave it out")),
    "reasoning": ((), "the policy has no reasoning settings; leave it out"),
    "max_tool_calls": ((), "the gateway cannot bound the policy's tool calls; leave it out"),
    "prompt": ((), "stored prompt templates are not kept here; send the prompt as instructions and input"),
    "context_management": ((), "this gateway never compacts the input; leave it out"),
}
KNOWN = frozenset(_PASSED + _TRANSLATED) | _NEUTRAL.keys()


def _fail(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param)


def _text(content: Any, where: str) -> Any:
    if isinstance(content, str) or content is None:
        return content or ""
    if isinstance(content, list):
        return [{"type": "text", "text": part.get("text")} if isinstance(part, dict) and part.get("type") in
                ("input_text", "output_text", "text") else part for part in content]
    raise _fail(f"{where}.content must be a string or a list of input_text parts", f"{where}.content")


def _text_options(text: Any) -> None:
    """`text`: plain text output only ({"format": {"type": "text"}}), no verbosity setting."""
    if text is None:
        return
    if not isinstance(text, dict):
        raise _fail("text must be an object: {'format': {'type': 'text'}}", "text")
    for key, value in text.items():
        if key == "format" and value not in (None, {"type": "text"}):
            raise ApiError(400, f"text.format {value!r} is not supported: the policy samples free text; send "
                           "{'type': 'text'} or leave it out", param="text.format", code="unsupported_parameter")
        if key == "verbosity" and value is not None:
            raise ApiError(400, "text.verbosity is not supported: the policy has no verbosity setting; leave it out",
                           param="text.verbosity", code="unsupported_parameter")
        if key not in ("format", "verbosity"):
            raise ApiError(400, f"unknown parameter text.{key}: send text={{'format': {{'type': 'text'}}}} or leave "
                           "it out", param=f"text.{key}", code="unknown_parameter")


def chat_body(body: Any) -> tuple[dict[str, Any], list[str]]:
    """The chat-completions body a Responses request stands for, and where each of its messages
    came from in the request (`instructions`, `input[i]`), to name in errors."""
    if not isinstance(body, dict):
        raise _fail("the body must be a JSON object", "body")
    for key, value in body.items():
        if key not in KNOWN:
            raise ApiError(400, f"unknown parameter {key!r}: this gateway takes the Responses API's fields (and "
                           "the seed and top_k extensions); leave it out", param=key, code="unknown_parameter")
        if key in _NEUTRAL and not is_neutral(value, _NEUTRAL[key][0]):
            raise ApiError(400, f"{key} is not supported at {value!r}: {_NEUTRAL[key][1]}", param=key,
                           code="unsupported_parameter")
    _text_options(body.get("text"))
    for key in ("previous_response_id", "conversation"):
        if body.get(key):
            raise _fail(f"{key} is not supported: this gateway keeps no responses; send the whole input each "
                        "turn", key)
    if body.get("store"):
        raise _fail("store=true is not supported: this gateway keeps no responses (sessions record the tokens)",
                    "store")
    messages: list[dict[str, Any]] = []
    sources: list[str] = []
    if body.get("instructions"):
        if not isinstance(body["instructions"], str):
            raise _fail("instructions must be a string", "instructions")
        messages.append({"role": "system", "content": body["instructions"]})
        sources.append("instructions")
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _fail("input must be a string or a non-empty list of items", "input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _text(item.get("content"), where)})
            sources.append(where)
        elif kind == "function_call":
            call = {"id": item.get("call_id", ""), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
                sources.append(where)
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                raise _fail(f"{where}.output must be a string", f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id", ""), "content": output})
            sources.append(where)
        else:
            raise _fail(f"{where} is a {kind!r} item; this gateway takes message, function_call and "
                        "function_call_output items", where)
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise _fail("tools must be a list of function tools", "tools")
    chat_tools = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise _fail(f"tools[{i}] must be {{'type': 'function', 'name', 'parameters'}}; other tool kinds are "
                        "not supported", f"tools[{i}]")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise _fail(f"tools[{i}].name is required: the function's name", f"tools[{i}].name")
        if not isinstance(tool.get("parameters", {}), dict):
            raise _fail(f"tools[{i}].parameters must be a JSON Schema object", f"tools[{i}].parameters")
        if not isinstance(tool.get("description", ""), str | None):
            raise _fail(f"tools[{i}].description must be a string", f"tools[{i}].description")
        chat_tools.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                                            if k in tool}})
    chat = {key: body[key] for key in _PASSED if key in body}
    chat |= {"messages": messages, "tools": chat_tools}
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = body["tool_choice"]
    return chat, sources


_CHAT_NAMES = re.compile(r"\bmessages\[(\d+)\]|\bmax_(?:completion_)?tokens\b|\bmessages\b")


def as_responses_error(error: ApiError, sources: list[str] | None = None) -> ApiError:
    """`error` in the Responses API's names: a chat message is the `input` item (or the
    `instructions`) it came from, `max_tokens` is `max_output_tokens`, `messages` is `input`."""
    def rename(text: str) -> str:
        def one(match: re.Match[str]) -> str:
            if match.group(1) is not None:
                index = int(match.group(1))
                return sources[index] if sources is not None and index < len(sources) else "input"
            return "max_output_tokens" if match.group(0).startswith("max_") else "input"
        return _CHAT_NAMES.sub(one, text)

    return ApiError(error.status, rename(error.message), type_=error.type,
                    param=rename(error.param) if error.param else error.param, code=error.code,
                    retry_after_s=error.retry_after_s)


def parse_responses_request(body: Any, max_context_tokens: int) -> ChatCall:
    chat, sources = chat_body(body)
    try:
        return parse_chat_request(chat, max_context_tokens)
    except ApiError as error:
        raise as_responses_error(error, sources) from None


def output_items(choice: Choice) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if choice.content or not choice.tool_calls:
        items.append({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": choice.content, "annotations": []}]})
    items += [{"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
               "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}
              for call in choice.tool_calls]
    return items


def response_object(response_id: str, model: str, created: int, choice: Choice | None, prompt_tokens: int,
                    items: list[dict[str, Any]] | None = None, status: str = "completed") -> dict[str, Any]:
    completion = len(choice.sample.completion_token_ids) if choice is not None else 0
    incomplete = choice is not None and choice.finish_reason == "length"
    return {
        "id": response_id, "object": "response", "created_at": created, "model": model,
        "status": "incomplete" if incomplete else status,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "output": items if items is not None else (output_items(choice) if choice is not None else []),
        "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "error": None,
        "usage": {"input_tokens": prompt_tokens, "output_tokens": completion,
                  "total_tokens": prompt_tokens + completion,
                  "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}},
    }
