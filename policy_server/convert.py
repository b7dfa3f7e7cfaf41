"""Protobuf <-> policy_server.types: the Generate request into a GenerationRequest (validating
what the client must fix; its messages and tools by `sciproto.chat`), and the backend's deltas and
samples back into stream events."""

from __future__ import annotations

from pydantic import ValidationError

from policy_server import types
from sciproto.chat import chat_message, invalid_request, tool_spec
from sciproto.pb import common_pb2, policy_pb2

_FINISH_REASONS = {
    types.FinishReason.STOP: policy_pb2.FINISH_REASON_STOP,
    types.FinishReason.LENGTH: policy_pb2.FINISH_REASON_LENGTH,
    types.FinishReason.ABORT: policy_pb2.FINISH_REASON_ABORT,
}


def sampling_params(request: policy_pb2.GenerateRequest, default_max_tokens: int,
                    max_samples: int) -> types.SamplingParams:
    sampling = request.sampling
    n = request.n or 1
    if n > max_samples:
        raise invalid_request(f"n is {n}; this server draws at most {max_samples} samples per request: "
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
        raise invalid_request(f"sampling.{field}: {message}" if field else f"sampling.{message}") from None


def generation_request(request: policy_pb2.GenerateRequest, default_max_tokens: int,
                       max_samples: int) -> types.GenerationRequest:
    """The backend request for a GenerateRequest; InvalidArgument says what to fix."""
    sampling = sampling_params(request, default_max_tokens, max_samples)
    which = request.WhichOneof("prompt")
    if which == "tokens":
        if not request.tokens.token_ids:
            raise invalid_request("tokens.token_ids is empty; give at least one prompt token")
        return types.GenerationRequest(prompt_token_ids=list(request.tokens.token_ids), sampling=sampling,
                                       request_id=request.request_id)
    if which == "chat":
        chat = request.chat
        if not chat.messages:
            raise invalid_request("chat.messages is empty; give at least one message")
        return types.GenerationRequest(
            messages=[chat_message(message, i) for i, message in enumerate(chat.messages)],
            tools=[tool_spec(tool, i) for i, tool in enumerate(chat.tools)],
            previous_token_ids=list(chat.previous_token_ids) or None,
            sampling=sampling,
            request_id=request.request_id,
        )
    raise invalid_request("the request has no prompt; set `chat` (messages) or `tokens` (token ids)")


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
