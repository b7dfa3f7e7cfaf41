"""The `openai` backend: an adapter to an existing OpenAI-compatible HTTP endpoint.

Chat requests go to `POST {base_url}/chat/completions`; token-id prompts go to
`POST {base_url}/completions` with the ids as the prompt (vLLM and SGLang accept that). Both
stream (server-sent events) and ask for the sampled tokens' log-probabilities (`logprobs`), and,
with `token_ids: true`, for token ids (`return_token_ids`, a vLLM extension). An endpoint that
gives no token ids leaves `completion_token_ids` empty; `info()` then lacks the "token_ids"
capability so a trainer can refuse to learn from such samples.

The weights belong to the endpoint: this backend cannot update them, and says so.

Retries: connection failures, 429 and 5xx answers are retried at most `max_attempts` times in
all, with exponential backoff (or the server's Retry-After, capped), but only before the first
event reached the caller: a stream that breaks later fails, since a retry would repeat tokens.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import torch

from policy_server.backends.options import OpenAIOptions
from policy_server.toolcalls import parse_completion
from policy_server.types import (
    BackendInfo,
    FinishReason,
    GenerationRequest,
    SampleResult,
    TensorSpec,
    TokenDelta,
    ToolCall,
    VersionSpan,
)
from sciproto.config import ConfigError
from sciproto.prompts import openai_function_tool

_FINISH_REASONS = {
    "stop": FinishReason.STOP,
    "tool_calls": FinishReason.STOP,  # the turn ended by calling tools
    "function_call": FinishReason.STOP,
    "content_filter": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
}
_RETRYABLE_STATUS = {408, 429, 500, 502, 503, 504}


class EndpointError(RuntimeError):
    """The endpoint refused the request or broke off its answer."""


@dataclass
class _Sample:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    # tool-call pieces of a chat stream by their index: {"id", "name", "arguments"}
    calls: dict[int, dict[str, str]] = field(default_factory=dict)


class OpenAIBackend:
    """PolicyBackend over an OpenAI-compatible endpoint; policy version is always 0."""

    def __init__(self, options: OpenAIOptions, model: str = "") -> None:
        self._options = options
        self._model = options.model or model
        if not self._model:
            raise ValueError("set openai.model (or the server's model) to the name the endpoint serves")
        headers = {}
        if options.api_key_env:
            key = os.environ.get(options.api_key_env)
            if not key:
                raise ValueError(f"environment variable {options.api_key_env} (openai.api_key_env) is not set")
            headers["Authorization"] = f"Bearer {key}"
        timeout = httpx.Timeout(options.read_timeout_s, connect=options.connect_timeout_s)
        self._client = httpx.AsyncClient(base_url=options.base_url.rstrip("/") + "/", headers=headers,
                                         timeout=timeout)

    # -- PolicyBackend -------------------------------------------------------------------------

    def info(self) -> BackendInfo:
        capabilities = ["chat", "prompt_token_ids", "tool_calls", "logprobs", "n_samples", "seed", "stop_strings"]
        if self._options.token_ids:
            capabilities.append("token_ids")
        return BackendInfo(model=self._model, backend="openai", dtype="", quantization="",
                           max_context=self._options.max_context, policy_version=0,
                           capabilities=capabilities, supports_weight_updates=False)

    @property
    def tokenizer(self) -> None:
        """None: the endpoint renders chat prompts with its own tokenizer."""
        return None

    def prompt_token_ids(self, request: GenerationRequest) -> list[int]:
        """Token prompts pass through; chat prompts are rendered by the endpoint, whose ids this
        backend does not know before sampling."""
        if request.prompt_token_ids is None:
            raise ValueError("the openai backend renders chat prompts at the endpoint and cannot give their "
                             "token ids in advance; send the messages to OpenAIBackend.generate")
        return list(request.prompt_token_ids)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta | SampleResult]:
        body, path = self._request_body(request)
        samples = [_Sample() for _ in range(request.sampling.n)]
        prompt: list[int] = list(request.prompt_token_ids or [])
        unfinished = request.sampling.n
        async for chunk in self._stream(path, body):
            prompt = prompt or list(chunk.get("prompt_token_ids") or [])
            for choice in chunk.get("choices") or []:
                index = choice.get("index", 0)
                if not 0 <= index < len(samples):
                    raise EndpointError(f"the endpoint answered choice {index} of a request for n={len(samples)}")
                prompt = prompt or list(choice.get("prompt_token_ids") or [])
                delta = self._apply_choice(samples[index], index, choice, chat=request.messages is not None)
                if delta.token_ids or delta.text:
                    yield delta
                if choice.get("finish_reason"):
                    unfinished -= 1
                    yield self._result(samples[index], index, choice["finish_reason"], prompt,
                                       chat=request.messages is not None)
        if unfinished:
            raise EndpointError(f"the endpoint's stream ended with {unfinished} of {len(samples)} samples unfinished")

    def weight_manifest(self) -> list[TensorSpec]:
        return []

    async def update_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        raise NotImplementedError("the openai backend serves someone else's endpoint and cannot change its "
                                  "weights; serve the policy with backend=transformers or vllm to train it")

    async def close(self) -> None:
        await self._client.aclose()

    # -- requests ------------------------------------------------------------------------------

    def _request_body(self, request: GenerationRequest) -> tuple[dict[str, Any], str]:
        sampling = request.sampling
        if sampling.top_k:
            # OpenAI's request body has no top_k: refused, never dropped
            raise ValueError(f"sampling.top_k is {sampling.top_k}, and the openai backend's endpoint takes no top_k;"
                             " leave it unset (0), or serve the model with the transformers or vllm backend")
        body: dict[str, Any] = {
            "model": self._model,
            "stream": True,
            "n": sampling.n,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_tokens": sampling.max_tokens,
        }
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if self._options.token_ids:
            body["return_token_ids"] = True
        if request.messages is None:
            # /completions: `logprobs` is how many alternatives besides the sampled token
            return body | {"prompt": list(request.prompt_token_ids or []), "logprobs": 0}, "completions"
        if request.previous_token_ids is not None:
            raise ValueError("the openai backend cannot extend previous_token_ids: the endpoint renders the chat")
        body |= {"messages": [message.to_template_dict() for message in request.messages],
                 "logprobs": True, "top_logprobs": 0}
        if request.tools:
            body["tools"] = [openai_function_tool(tool) for tool in request.tools]
        return body, "chat/completions"

    async def _stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The JSON chunks of one streamed answer, retrying as the module docstring says."""
        options = self._options
        delay = options.backoff_s
        for attempt in range(1, options.max_attempts + 1):
            started = False
            try:
                async with self._client.stream("POST", path, json=body) as response:
                    if response.status_code in _RETRYABLE_STATUS and attempt < options.max_attempts:
                        delay = _retry_after(response, delay, options.max_backoff_s)
                        raise _Retry(f"HTTP {response.status_code}")
                    if response.status_code != 200:
                        detail = (await response.aread()).decode(errors="replace")[:500]
                        raise EndpointError(f"POST {path} answered HTTP {response.status_code}: {detail}")
                    async for chunk in _server_sent_events(response):
                        started = True
                        yield chunk
                    return
            except (_Retry, httpx.TransportError) as error:
                if started or attempt == options.max_attempts:
                    raise EndpointError(f"POST {path} failed after {attempt} attempt(s): {error!r}") from error
            await asyncio.sleep(min(delay, options.max_backoff_s))
            delay *= 2

    # -- responses -----------------------------------------------------------------------------

    def _apply_choice(self, sample: _Sample, index: int, choice: dict[str, Any], chat: bool) -> TokenDelta:
        if chat:
            delta = choice.get("delta") or {}
            text = delta.get("content") or ""
            for piece in delta.get("tool_calls") or []:
                call = sample.calls.setdefault(piece.get("index", len(sample.calls)),
                                               {"id": "", "name": "", "arguments": ""})
                function = piece.get("function") or {}
                call["id"] = piece.get("id") or call["id"]
                call["name"] += function.get("name") or ""
                call["arguments"] += function.get("arguments") or ""
            logprobs = [float(entry["logprob"]) for entry in (choice.get("logprobs") or {}).get("content") or []]
        else:
            text = choice.get("text") or ""
            logprobs = [float(value) for value in (choice.get("logprobs") or {}).get("token_logprobs") or []]
        tokens = [int(token) for token in choice.get("token_ids") or []]
        if self._options.token_ids and text and not tokens:
            raise EndpointError("the endpoint gave no token_ids although return_token_ids was asked (openai.token_ids "
                                "is true); use an endpoint that supports it, e.g. vLLM, or set token_ids false")
        sample.tokens += tokens
        sample.logprobs += logprobs
        sample.text += text
        return TokenDelta(index, tokens, text, logprobs)

    def _result(self, sample: _Sample, index: int, finish_reason: str, prompt: list[int], chat: bool) -> SampleResult:
        finish = _FINISH_REASONS.get(finish_reason)
        if finish is None:
            raise EndpointError(f"the endpoint ended sample {index} with unknown finish_reason {finish_reason!r}")
        if chat:
            content, (tool_calls, malformed) = sample.text.strip(), _tool_calls(sample.calls)
        else:  # a raw completion carries the model's own tool-call markup
            parsed = parse_completion(sample.text)
            content, tool_calls, malformed = parsed.content, parsed.tool_calls, parsed.malformed
        sampled = len(sample.tokens) or len(sample.logprobs)
        return SampleResult(
            sample_index=index,
            prompt_token_ids=prompt,
            completion_token_ids=sample.tokens,
            logprobs=sample.logprobs,
            finish_reason=finish,
            text=sample.text,
            content=content,
            tool_calls=tool_calls,
            malformed=malformed,
            version_spans=[VersionSpan(0, sampled, 0)] if sampled else [],
        )


class _Retry(Exception):
    """An answer worth another try."""


def _tool_calls(calls: dict[int, dict[str, str]]) -> tuple[list[ToolCall], bool]:
    """Assembled tool calls in index order; one whose arguments are not a JSON object is dropped
    and marks the sample malformed."""
    parsed, malformed = [], False
    for index in sorted(calls):
        call = calls[index]
        try:
            arguments = json.loads(call["arguments"] or "{}")
        except json.JSONDecodeError:
            arguments = None
        if not call["name"] or not isinstance(arguments, dict):
            malformed = True
            continue
        parsed.append(ToolCall(call["id"] or f"call_{index}", call["name"], json.dumps(arguments, ensure_ascii=False)))
    return parsed, malformed


async def _server_sent_events(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """JSON payloads of `data:` lines until `data: [DONE]`."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, comments, event names
        payload = line[len("data:"):].strip()
        if payload == "[DONE]":
            return
        chunk = json.loads(payload)
        if "error" in chunk:
            raise EndpointError(f"the endpoint reported an error mid-stream: {chunk['error']}")
        yield chunk


def _retry_after(response: httpx.Response, default_s: float, cap_s: float) -> float:
    try:
        return min(float(response.headers.get("retry-after", default_s)), cap_s)
    except ValueError:  # an HTTP date: fall back to our own backoff
        return min(default_s, cap_s)


def build_backend(config: Any) -> OpenAIBackend:
    """The hook `policy_server.app` calls, for a PolicyServerConfig whose `openai:` section holds
    OpenAIOptions; `config.model` names the served model when openai.model is empty."""
    if config.openai is None:
        raise ConfigError("backend openai needs its endpoint: set openai.base_url (e.g. --set "
                          "openai.base_url=http://127.0.0.1:8000/v1)")
    return OpenAIBackend(config.openai, model=config.model)
