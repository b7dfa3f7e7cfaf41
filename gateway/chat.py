"""`POST /v1/chat/completions` bodies: validation into a `ChatCall` (the Generate request's parts,
plus a normal form of the messages that sessions compare), and the OpenAI response objects built
from Generate's samples."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import ApiError
from sciproto.pb import common_pb2, policy_pb2

__all__ = ["FINISH_NAMES", "KNOWN", "ChatCall", "Choice", "check_fields", "chunk_object", "completion_object",
           "is_neutral", "parse_chat_request"]

_ROLES = {"system": common_pb2.ROLE_SYSTEM, "developer": common_pb2.ROLE_SYSTEM, "user": common_pb2.ROLE_USER,
          "assistant": common_pb2.ROLE_ASSISTANT, "tool": common_pb2.ROLE_TOOL}
FINISH_NAMES = {policy_pb2.FINISH_REASON_STOP: "stop", policy_pb2.FINISH_REASON_LENGTH: "length",
                policy_pb2.FINISH_REASON_ABORT: "abort", policy_pb2.FINISH_REASON_UNSPECIFIED: "stop"}
MAX_N = 64

# Every top-level field of OpenAI's chat-completions body (the `openai` SDK's
# CompletionCreateParams), and the sampling extensions vLLM's server takes, is one of three kinds;
# any other key is refused with a 400 naming it (as OpenAI answers an unknown argument). A null
# value is the field left out. docs/guides/own-agent.md has the table and the reason for each.
# Honoured: read by parse_chat_request into the Generate request (or the answer's shape).
HONOURED = frozenset({"messages", "model", "tools", "tool_choice", "n", "temperature", "top_p", "top_k",
                      "max_tokens", "max_completion_tokens", "stop", "seed", "logprobs", "top_logprobs", "stream",
                      "stream_options"})
# Bookkeeping: they say who asks or how to cache, and change nothing the model samples; checked
# for their type, then not kept.
BOOKKEEPING: dict[str, type] = {"user": str, "safety_identifier": str, "prompt_cache_key": str, "metadata": dict,
                                "prompt_cache_options": dict, "prompt_cache_retention": str}
# Refused unless at the value that asks for nothing beyond sampling as Generate does it (None:
# no value but null passes). A penalty, a bias, a format, audio or a reasoning setting would
# change what is sampled in a way the policy servers do not apply, so the learner would train
# tokens under a distribution other than the one that drew them.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,), "min_p": (0,),
    "logit_bias": ({},), "response_format": ({"type": "text"},), "parallel_tool_calls": (True,),
    "modalities": (["text"],), "store": (False,), "service_tier": ("auto", "default"),
    "audio": (), "prediction": (), "reasoning_effort": (), "verbosity": (), "web_search_options": (),
    "moderation": (), "functions": (), "function_call": (),
}
_REFUSALS = {
    "presence_penalty": "the policy servers apply no penalties; leave it out or send 0",
    "frequency_penalty": "the policy servers apply no penalties; leave it out or send 0",
    "repetition_penalty": "the policy servers apply no penalties; leave it out or send 1",
    "min_p": "the policy servers apply no min-p truncation; leave it out or send 0 (top_p and top_k are honoured)",
    "logit_bias": "the policy servers apply no logit bias; leave it out",
    "response_format": "the policy samples free text; send {'type': 'text'} or leave it out",
    "parallel_tool_calls": "the policy may write several tool calls in one turn and the gateway cannot stop it; "
                           "leave it out or send true",
    "modalities": "this model writes text only; send ['text'] or leave it out",
    "store": "this gateway keeps no completions (sessions record the tokens); leave it out or send false",
    "service_tier": "this gateway has one tier; send 'auto' or 'default', or leave it out",
    "audio": "this model writes text only; leave it out",
    "prediction": "predicted outputs are not supported; leave it out",
    "reasoning_effort": "the policy has no reasoning-effort setting; leave it out",
    "verbosity": "the policy has no verbosity setting; leave it out",
    "web_search_options": "there is no web search here; leave it out",
    "moderation": "this gateway runs no moderation; leave it out",
    "functions": "the legacy `functions` list is not supported; send the same functions as tools=[{'type': "
                 "'function', 'function': {...}}] (tool calls come back as `tool_calls`)",
    "function_call": "the legacy `function_call` is not supported; send tools with tool_choice 'auto' or 'none'",
}
KNOWN = HONOURED | BOOKKEEPING.keys() | NEUTRAL.keys()


@dataclass
class ChatCall:
    """One validated chat-completion request."""

    model: str
    messages: list[common_pb2.ChatMessage]
    normal_messages: list[dict[str, Any]]  # what sessions compare, call to call
    tools: list[common_pb2.ToolSpec]
    normal_tools: list[dict[str, Any]]
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False
    adapter: str = ""  # the policy server's LoRA adapter `model` routes to ("": the base weights)

    def sampling_params(self) -> policy_pb2.SamplingParams:
        """The sampling the call asks Generate for (unset fields: the policy server's defaults)."""
        return policy_pb2.SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                         max_tokens=self.max_tokens, stop=self.stop, seed=self.seed)

    def generate_request(self, previous_token_ids: list[int], request_id: str) -> policy_pb2.GenerateRequest:
        chat = policy_pb2.ChatPrompt(messages=self.messages, tools=self.tools, previous_token_ids=previous_token_ids)
        return policy_pb2.GenerateRequest(request_id=request_id, chat=chat, sampling=self.sampling_params(), n=self.n,
                                          adapter=self.adapter)


@dataclass
class Choice:
    """One finished sample as the caller sees it."""

    index: int
    sample: policy_pb2.GenerateSample
    with_tools: bool

    @property
    def content(self) -> str:
        # With tools the completion's tool-call markup becomes `tool_calls`; without, the text is
        # the answer as sampled.
        return self.sample.content if self.with_tools else self.sample.text

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        if not self.with_tools:
            return []
        return [{"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
                for call in self.sample.tool_calls]

    @property
    def finish_reason(self) -> str:
        if self.tool_calls and self.sample.finish_reason == policy_pb2.FINISH_REASON_STOP:
            return "tool_calls"
        return FINISH_NAMES.get(self.sample.finish_reason, "stop")

    def message(self) -> dict[str, Any]:
        calls = self.tool_calls
        message: dict[str, Any] = {"role": "assistant", "content": self.content if (self.content or not calls) else None}
        if calls:
            message["tool_calls"] = calls
        return message

    def normal_message(self) -> dict[str, Any]:
        """The assistant message this choice becomes when the caller sends it back."""
        return normal_message("assistant", self.content, [(c["function"]["name"], c["function"]["arguments"])
                                                           for c in self.tool_calls], "")

    def logprobs(self) -> dict[str, Any]:
        return {"content": logprob_entries(self.sample.completion_token_ids, self.sample.logprobs)}


def logprob_entries(token_ids: Any, logprobs: Any) -> list[dict[str, Any]]:
    """OpenAI's per-token entries. The gateway holds no tokenizer: a token is named
    "token_id:ID" (vLLM's convention); only the sampled token's logprob exists."""
    return [{"token": f"token_id:{token}", "logprob": float(lp), "bytes": None, "top_logprobs": []}
            for token, lp in zip(token_ids, logprobs, strict=True)]


def normal_message(role: str, content: str, calls: list[tuple[str, str]], tool_call_id: str) -> dict[str, Any]:
    def arguments(text: str) -> Any:
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text

    return {"role": role, "content": content.strip(), "tool_calls": [(name, arguments(args)) for name, args in calls],
            "tool_call_id": tool_call_id}


def _fail(message: str, param: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise _fail(f"{where}.content[{i}] is a {kind!r} part; this model takes text parts only",
                            f"{where}.content")
            if not isinstance(part.get("text"), str):
                raise _fail(f"{where}.content[{i}] has no string 'text'", f"{where}.content")
            texts.append(part["text"])
        return "\n".join(texts)
    raise _fail(f"{where}.content must be a string or a list of text parts", f"{where}.content")


def _message(raw: Any, i: int) -> tuple[common_pb2.ChatMessage, dict[str, Any]]:
    where = f"messages[{i}]"
    if not isinstance(raw, dict):
        raise _fail(f"{where} must be an object with 'role' and 'content'", where)
    role = raw.get("role")
    if role not in _ROLES:
        raise _fail(f"{where}.role is {role!r}; use one of {sorted(_ROLES)}", f"{where}.role")
    if raw.get("function_call") is not None:
        raise _fail(f"{where}.function_call is the legacy form of a tool call; send it as tool_calls=[{{'id', "
                    "'type': 'function', 'function': {'name', 'arguments'}}]", f"{where}.function_call")
    if raw.get("audio") is not None:
        raise _fail(f"{where}.audio is not supported: this model reads and writes text only", f"{where}.audio")
    content = _content_text(raw.get("content"), where)
    calls: list[tuple[str, str, str]] = []
    for j, call in enumerate(raw.get("tool_calls") or []):
        function = call.get("function") if isinstance(call, dict) else None
        if role != "assistant" or not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _fail(f"{where}.tool_calls[{j}] must be {{'id', 'type': 'function', 'function': {{'name', "
                        "'arguments'}}}} on an assistant message", f"{where}.tool_calls")
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        calls.append((str(call.get("id", "")), function["name"], arguments))
    tool_call_id = raw.get("tool_call_id") or ""
    if role == "tool" and not isinstance(tool_call_id, str):
        raise _fail(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id")
    name = raw.get("name") or ""
    message = common_pb2.ChatMessage(
        role=_ROLES[role], content=content, tool_call_id=tool_call_id, name=name if isinstance(name, str) else "",
        tool_calls=[common_pb2.ToolCall(id=cid, name=cname, arguments=args) for cid, cname, args in calls])
    normal_role = "system" if role == "developer" else role
    return message, normal_message(normal_role, content, [(cname, args) for _, cname, args in calls], tool_call_id)


def _tool(raw: Any, i: int) -> tuple[common_pb2.ToolSpec, dict[str, Any]]:
    where = f"tools[{i}]"
    function = raw.get("function") if isinstance(raw, dict) and raw.get("type") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise _fail(f"{where} must be {{'type': 'function', 'function': {{'name': str, 'description': str, "
                    "'parameters': JSON Schema object}}}}", where, "invalid_tools")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise _fail(f"{where}.function.parameters must be a JSON Schema object", f"{where}.function.parameters",
                    "invalid_tools")
    description = function.get("description") or ""
    if not isinstance(description, str):
        raise _fail(f"{where}.function.description must be a string", f"{where}.function.description", "invalid_tools")
    spec = common_pb2.ToolSpec(name=function["name"], description=description,
                               parameters_json_schema=json.dumps(parameters, sort_keys=True))
    return spec, {"name": function["name"], "description": description, "parameters": parameters}


def _number(body: dict[str, Any], key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise _fail(f"{key} must be a number in [{low}, {high}], got {value!r}", key)
    return float(value)


def _top_p(body: dict[str, Any]) -> float | None:
    """top_p in (0, 1]: 0 keeps no token (the policy server refuses it, in its own words)."""
    value = _number(body, "top_p", 0, 1)
    if value == 0:
        raise _fail("top_p must be in (0, 1], got 0; leave it unset for no nucleus sampling", "top_p")
    return value


def is_neutral(value: Any, allowed: tuple[Any, ...]) -> bool:
    """`value` is null or one of `allowed`, compared as JSON compares (true is not 1)."""
    if value is None:
        return True
    for choice in allowed:
        if isinstance(choice, bool) or not isinstance(choice, int | float):
            if type(value) is type(choice) and value == choice:
                return True
        elif isinstance(value, int | float) and not isinstance(value, bool) and value == choice:
            return True
    return False


def _short(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, dict | list) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_fields(body: dict[str, Any]) -> None:
    """Refuse a key this gateway does not know, a field it cannot honour at the value sent, and
    bookkeeping of the wrong type; every refusal names the field."""
    for key, value in body.items():
        if key not in KNOWN:
            raise ApiError(400, f"unknown parameter {key!r}: this gateway takes OpenAI's chat-completions fields "
                           "(and the top_k extension); leave it out", param=key, code="unknown_parameter")
        if key in NEUTRAL and not is_neutral(value, NEUTRAL[key]):
            raise ApiError(400, f"{key}={_short(value)} is not supported: {_REFUSALS[key]}", param=key,
                           code="unsupported_parameter")
        kind = BOOKKEEPING.get(key)
        if kind is not None and value is not None and not isinstance(value, kind):
            raise _fail(f"{key} must be a {'string' if kind is str else 'JSON object'}, got {_short(value)}", key)


def _top_k(body: dict[str, Any]) -> int | None:
    """top_k (vLLM's extension): sample among the k likeliest tokens (SamplingParams.top_k); 0 or
    -1 (vLLM's "off") and null leave it unset."""
    value = _integer(body, "top_k", -1, (1 << 32) - 1)
    return None if value is None or value in (0, -1) else value


def _stream_options(body: dict[str, Any]) -> bool:
    """stream_options: include_usage (honoured) and include_obfuscation (no padding is sent
    either way: it changes the events' size, never their content). Returns include_usage."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise _fail("stream_options must be an object: {'include_usage': bool}", "stream_options")
    for key, value in options.items():
        if key not in ("include_usage", "include_obfuscation"):
            raise ApiError(400, f"unknown parameter stream_options.{key}: send include_usage (and "
                           "include_obfuscation) only", param=f"stream_options.{key}", code="unknown_parameter")
        if value is not None and not isinstance(value, bool):
            raise _fail(f"stream_options.{key} must be true or false", f"stream_options.{key}")
    return bool(options.get("include_usage"))


def _integer(body: dict[str, Any], key: str, low: int, high: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _fail(f"{key} must be an integer in [{low}, {high}], got {value!r}", key)
    return value


def parse_chat_request(body: Any, max_context_tokens: int) -> ChatCall:
    """Validate a request body; every refusal names the field and what to send instead."""
    if not isinstance(body, dict):
        raise _fail("the body must be a JSON object", "body")
    check_fields(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _fail("model is required: a name from GET /v1/models", "model")
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise _fail("messages must be a non-empty list", "messages")
    parsed = [_message(raw, i) for i, raw in enumerate(raw_messages)]
    raw_tools = body.get("tools") or []
    if not isinstance(raw_tools, list):
        raise _fail("tools must be a list of function tools", "tools", "invalid_tools")
    tools = [_tool(raw, i) for i, raw in enumerate(raw_tools)]
    tool_choice = body.get("tool_choice", "auto")
    if tool_choice not in ("auto", "none", None):
        raise _fail(f"tool_choice {tool_choice!r} is not supported: the policy samples freely ('auto'); send 'auto' "
                    "or 'none' (no tools in the prompt)", "tool_choice")
    if tool_choice == "none":
        tools = []
    top_logprobs = _integer(body, "top_logprobs", 0, 20)
    if top_logprobs:
        raise _fail("top_logprobs > 0 is not supported: the policy returns the sampled token's logprob only; "
                    "send logprobs=true with top_logprobs 0 or unset", "top_logprobs")
    max_tokens = _integer(body, "max_completion_tokens", 1, 1 << 30)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1, 1 << 30)
    if max_tokens is not None and max_tokens >= max_context_tokens:
        raise _fail(f"max_tokens is {max_tokens}, but the model's context holds {max_context_tokens} tokens of prompt "
                    "and completion together; ask for fewer", "max_tokens", "context_length_exceeded")
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise _fail("stop must be a string or a list of at most 4 non-empty strings", "stop")
    logprobs = body.get("logprobs") or False
    if not isinstance(logprobs, bool):
        raise _fail("logprobs must be true or false", "logprobs")
    seed = _integer(body, "seed", -(1 << 63), (1 << 64) - 1)
    return ChatCall(
        model=model, messages=[m for m, _ in parsed], normal_messages=[n for _, n in parsed],
        tools=[t for t, _ in tools], normal_tools=[n for _, n in tools],
        n=_integer(body, "n", 1, MAX_N) or 1, temperature=_number(body, "temperature", 0, 2),
        top_p=_top_p(body), top_k=_top_k(body), max_tokens=max_tokens or 0, stop=stops,
        seed=None if seed is None else seed % (1 << 64), logprobs=logprobs, stream=bool(body.get("stream")),
        include_usage=_stream_options(body))


def completion_object(completion_id: str, model: str, created: int, choices: list[Choice], prompt_tokens: int,
                      logprobs: bool) -> dict[str, Any]:
    return {
        "id": completion_id, "object": "chat.completion", "created": created, "model": model,
        "system_fingerprint": None,
        "choices": [{"index": c.index, "message": c.message(), "finish_reason": c.finish_reason,
                     "logprobs": c.logprobs() if logprobs else None} for c in choices],
        "usage": usage(prompt_tokens, choices),
    }


def usage(prompt_tokens: int, choices: list[Choice]) -> dict[str, int]:
    completion = sum(len(c.sample.completion_token_ids) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def chunk_object(completion_id: str, model: str, created: int, choices: list[dict[str, Any]],
                 usage_: dict[str, int] | None = None) -> dict[str, Any]:
    chunk: dict[str, Any] = {"id": completion_id, "object": "chat.completion.chunk", "created": created,
                             "model": model, "system_fingerprint": None, "choices": choices}
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def now() -> int:
    return int(time.time())
