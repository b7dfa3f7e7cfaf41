"""The openai backend against a real OpenAI-compatible HTTP server in its own process."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from policy_server.backends.openai_backend import (
    EndpointError,
    OpenAIBackend,
    OpenAIOptions,
    build_backend,
)
from policy_server.config import PolicyServerConfig
from policy_server.types import (
    ChatMessage,
    FinishReason,
    GenerationRequest,
    SampleResult,
    SamplingParams,
    TokenDelta,
)

STUB = Path(__file__).with_name("openai_stub_server.py")
CHAT_TEXT = "The answer is 4."
TOOL = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    process = subprocess.Popen([sys.executable, str(STUB)], stdout=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()  # the server prints its port before it serves
        assert line.startswith("PORT "), f"stub server did not start: {line!r}"
        base = f"http://127.0.0.1:{int(line.split()[1])}"
        for _ in range(100):  # wait until it accepts connections (bounded)
            try:
                httpx.get(f"{base}/stats", timeout=1.0)
                break
            except httpx.TransportError:
                time.sleep(0.05)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()


def _backend(endpoint: str, model: str = "stub", **options) -> OpenAIBackend:
    return OpenAIBackend(OpenAIOptions(base_url=f"{endpoint}/v1", model=model, **options))


async def _run(backend: OpenAIBackend, request: GenerationRequest) -> tuple[list[SampleResult], list[TokenDelta]]:
    results, deltas = [], []
    try:
        async for event in backend.generate(request):
            (results if isinstance(event, SampleResult) else deltas).append(event)
    finally:
        await backend.close()
    return sorted(results, key=lambda r: r.sample_index), deltas


async def _stats(endpoint: str) -> dict[str, int]:
    async with httpx.AsyncClient(timeout=5.0) as client:
        return (await client.get(f"{endpoint}/stats")).json()


def _chat(**sampling) -> GenerationRequest:
    return GenerationRequest(messages=[ChatMessage("user", "What is 2+2?")], sampling=SamplingParams(**sampling))


async def test_chat_streams_text_logprobs_and_token_ids(endpoint):
    results, deltas = await _run(_backend(endpoint, token_ids=True), _chat(n=2))
    assert [r.sample_index for r in results] == [0, 1]
    for result in results:
        assert result.text == CHAT_TEXT and result.content == CHAT_TEXT
        assert result.finish_reason is FinishReason.STOP
        assert result.completion_token_ids == list(CHAT_TEXT.encode())
        assert len(result.logprobs) == len(result.completion_token_ids)
        assert all(value < 0 for value in result.logprobs)
        assert result.prompt_token_ids == [1, 2, 3]
        assert [(s.start, s.end, s.version) for s in result.version_spans] == [(0, len(CHAT_TEXT), 0)]
    assert "".join(d.text for d in deltas if d.sample_index == 1) == CHAT_TEXT
    assert len(deltas) == 6  # three content chunks per sample


async def test_chat_tool_calls_are_assembled_from_pieces(endpoint):
    request = GenerationRequest(messages=[ChatMessage("user", "compute 2+2")], tools=[TOOL])
    results, _ = await _run(_backend(endpoint), request)
    (result,) = results
    assert len(result.tool_calls) == 1
    call = result.tool_calls[0]
    assert call.id == "call_0" and call.name == "calculator"
    assert json.loads(call.arguments) == {"expression": "2+2"}
    assert not result.malformed and result.finish_reason is FinishReason.STOP


async def test_without_token_ids_the_capability_is_absent(endpoint):
    backend = _backend(endpoint)
    assert "token_ids" not in backend.info().capabilities
    results, _ = await _run(backend, _chat())
    assert results[0].completion_token_ids == [] and results[0].logprobs  # logprobs still mapped


async def test_token_prompts_use_completions(endpoint):
    request = GenerationRequest(prompt_token_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=3))
    backend = _backend(endpoint, token_ids=True)
    assert backend.prompt_token_ids(request) == [5, 6, 7]
    results, _ = await _run(backend, request)
    (result,) = results
    assert result.text == "ok ok ok "
    assert result.completion_token_ids == list(b"ok ok ok ")
    assert result.prompt_token_ids == [5, 6, 7]
    assert result.finish_reason is FinishReason.LENGTH


async def test_busy_answers_are_retried_within_the_bound(endpoint):
    results, _ = await _run(_backend(endpoint, model="busy-2", max_attempts=3, backoff_s=0.0), _chat())
    assert results[0].text == CHAT_TEXT
    with pytest.raises(EndpointError, match="HTTP 503"):
        await _run(_backend(endpoint, model="busy-5", max_attempts=2, backoff_s=0.0), _chat())
    counts = await _stats(endpoint)
    assert counts["busy-2"] == 3  # two refusals, then the answer
    assert counts["busy-5"] == 2  # exactly max_attempts tries, no more


async def test_a_silent_endpoint_times_out_after_bounded_attempts(endpoint):
    backend = _backend(endpoint, model="hang", read_timeout_s=0.3, max_attempts=2, backoff_s=0.0)
    with pytest.raises(EndpointError, match="after 2 attempt"):
        await _run(backend, _chat())
    assert (await _stats(endpoint))["hang"] == 2


async def test_weight_updates_are_refused(endpoint):
    backend = _backend(endpoint)
    info = backend.info()
    assert info.supports_weight_updates is False and info.backend == "openai"
    assert backend.weight_manifest() == []
    with pytest.raises(NotImplementedError, match="cannot change its weights"):
        await backend.update_weights(1, {"w": torch.zeros(1)})
    await backend.close()


async def test_build_backend_reads_the_openai_section_and_the_api_key_env(monkeypatch):
    config = PolicyServerConfig(backend="openai", model="served-name",
                                openai={"base_url": "http://127.0.0.1:1/v1", "api_key_env": "SCIPROTO_TEST_KEY"})
    with pytest.raises(ValueError, match="SCIPROTO_TEST_KEY"):
        build_backend(config)
    monkeypatch.setenv("SCIPROTO_TEST_KEY", "secret")
    backend = build_backend(config)
    assert backend.info().model == "served-name"
    with pytest.raises(ValueError, match="renders chat prompts at the endpoint"):
        backend.prompt_token_ids(_chat())
    await backend.close()
