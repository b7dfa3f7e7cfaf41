"""Protobuf <-> policy_server.types: the Generate request into a GenerationRequest (validating
what the client must fix), and the backend's deltas and samples back into stream events."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from policy_server import types
from sciproto.errors import InvalidArgument, Reason, Unimplemented
from sciproto.pb import common_pb2, policy_pb2

_ROLES = {
    common_pb2.ROLE_SYSTEM: "system",
    common_pb2.ROLE_USER: "user",
    common_pb2.ROLE_ASSISTANT: "assistant",
    common_pb2.ROLE_TOOL: "tool",
}

_FINISH_REASONS = {
    types.FinishReason.STOP: policy_pb2.FINISH_REASON_STOP,
    types.FinishReason.LENGTH: policy_pb2.FINISH_REASON_LENGTH,
    types.FinishReason.ABORT: policy_pb2.FINISH_REASON_ABORT,
}


def _invalid(message: str) -> InvalidArgument:
    return InvalidArgument(message, Reason.INVALID_REQUEST)


def chat_message(message: common_pb2.ChatMessage, index: int) -> types.ChatMessage:
    role = _ROLES.get(message.role)
    if role is None:
        raise _invalid(f"chat.messages[{index}].role is unset; set it to ROLE_SYSTEM, ROLE_USER, "
                       "ROLE_ASSISTANT or ROLE_TOOL")
    empty = next((number for number, part in enumerate(message.parts) if part.WhichOneof("part") is None), None)
    if empty is not None:
        raise _invalid(f"chat.messages[{index}].parts[{empty}] is empty; set its text, image or file")
    kinds = {str(part.WhichOneof("part")) for part in message.parts} - {"text"}
    if kinds:
        # Every backend here serves a text-only model; a part it cannot see is refused, never dropped.
        raise Unimplemented(
            f"chat.messages[{index}] has {' and '.join(sorted(kinds))} parts, and this server's model takes"
            " text only: send the message's text (ChatMessage.content) without its parts, or use a policy"
            " server whose Describe lists the content.image capability", Reason.UNSUPPORTED,
            metadata={"message_index": str(index), "part_kinds": ",".join(sorted(kinds))})
    text = message.content or "\n".join(part.text for part in message.parts)
    return types.ChatMessage(
        role=role,
        content=text,
        tool_calls=[types.ToolCall(call.id, call.name, call.arguments) for call in message.tool_calls],
        tool_call_id=message.tool_call_id or None,
        name=message.name or None,
    )


def tool_spec(tool: common_pb2.ToolSpec, index: int) -> dict[str, Any]:
    """The OpenAI function-tool dict of a ToolSpec."""
    if not tool.name:
        raise _invalid(f"chat.tools[{index}].name is empty; give the function name")
    try:
        parameters = json.loads(tool.parameters_json_schema) if tool.parameters_json_schema else {"type": "object"}
    except json.JSONDecodeError as error:
        raise _invalid(f"chat.tools[{index}] ({tool.name}): parameters_json_schema is not JSON: {error}") from error
    if not isinstance(parameters, dict):
        raise _invalid(f"chat.tools[{index}] ({tool.name}): parameters_json_schema must be a JSON object")
    function = {"name": tool.name, "description": tool.description, "parameters": parameters}
    return {"type": "function", "function": function}


def sampling_params(request: policy_pb2.GenerateRequest, default_max_tokens: int,
                    max_samples: int) -> types.SamplingParams:
    sampling = request.sampling
    n = request.n or 1
    if n > max_samples:
        raise _invalid(f"n is {n}; this server draws at most {max_samples} samples per request: "
                       "split the group into several requests")
    # proto3 `optional`: an unset temperature / top_p / top_k takes sciproto.sampling's default,
    # not the zero default
    given = {name: getattr(sampling, name) for name in ("temperature", "top_p", "top_k", "seed")
             if sampling.HasField(name)}
    try:
        return types.SamplingParams(**given, max_tokens=sampling.max_tokens or default_max_tokens,
                                    stop=list(sampling.stop), n=n)
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        message = str(first["ctx"]["error"]) if "ctx" in first and "error" in first["ctx"] else first["msg"]
        # a range check's message starts with the field's name (sciproto.sampling.check_sampling)
        raise _invalid(f"sampling.{field}: {message}" if field else f"sampling.{message}") from None


def generation_request(request: policy_pb2.GenerateRequest, default_max_tokens: int,
                       max_samples: int) -> types.GenerationRequest:
    """The backend request for a GenerateRequest; InvalidArgument says what to fix."""
    sampling = sampling_params(request, default_max_tokens, max_samples)
    which = request.WhichOneof("prompt")
    if which == "tokens":
        if not request.tokens.token_ids:
            raise _invalid("tokens.token_ids is empty; give at least one prompt token")
        return types.GenerationRequest(prompt_token_ids=list(request.tokens.token_ids), sampling=sampling,
                                       request_id=request.request_id)
    if which == "chat":
        chat = request.chat
        if not chat.messages:
            raise _invalid("chat.messages is empty; give at least one message")
        return types.GenerationRequest(
            messages=[chat_message(message, i) for i, message in enumerate(chat.messages)],
            tools=[tool_spec(tool, i) for i, tool in enumerate(chat.tools)],
            previous_token_ids=list(chat.previous_token_ids) or None,
            sampling=sampling,
            request_id=request.request_id,
        )
    raise _invalid("the request has no prompt; set `chat` (messages) or `tokens` (token ids)")


def delta_event(delta: types.TokenDelta) -> policy_pb2.GenerateResponse:
    return policy_pb2.GenerateResponse(delta=policy_pb2.TokenDelta(
        sample_index=delta.sample_index, token_ids=delta.token_ids, text=delta.text, logprobs=delta.logprobs,
    ))


def sample_event(sample: types.SampleResult) -> policy_pb2.GenerateResponse:
    return policy_pb2.GenerateResponse(sample=policy_pb2.GenerateSample(
        sample_index=sample.sample_index,
        completion_token_ids=sample.completion_token_ids,
        logprobs=sample.logprobs,
        finish_reason=_FINISH_REASONS[sample.finish_reason],
        text=sample.text,
        content=sample.content,
        tool_calls=[common_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in sample.tool_calls],
        tool_call_malformed=sample.malformed,
        version_spans=[common_pb2.VersionSpan(start=s.start, end=s.end, policy_version=s.version)
                       for s in sample.version_spans],
    ))


def prompt_event(token_ids: list[int], policy_version: int) -> policy_pb2.GenerateResponse:
    return policy_pb2.GenerateResponse(prompt=policy_pb2.GeneratePrompt(token_ids=token_ids,
                                                                        policy_version=policy_version))
