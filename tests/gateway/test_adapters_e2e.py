"""The gateway over a policy server holding LoRA adapters (protocol 1.4), each in its own process:
/v1/models lists every adapter, and a call whose `model` names one samples with it, exactly as a
Generate naming that adapter does; the served model's own names keep the base weights."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import openai
import pytest
import torch

from sciproto.client.policy import PolicyClient, generate_request
from sciproto.lora import LoraSpec, adapter_tensor_specs, linear_layers
from sciproto.models import load_model
from sciproto.pb import common_pb2
from sciproto.processes import ServerProcess
from sciproto.weights.wire import tensor_digests
from tests.gateway.conftest import running_gateway

ADAPTER = LoraSpec(name="team-a", rank=4, alpha=16.0)
QUESTION = [{"role": "user", "content": "What is 2+2?"}]


def adapter_tensors(seed: int) -> dict[str, torch.Tensor]:
    base = load_model("tiny", dtype=torch.float32, seed=3).model
    generator = torch.Generator().manual_seed(seed)
    return {spec.name: torch.randn(spec.shape, generator=generator) * 0.2
            for spec in adapter_tensor_specs(linear_layers(base), ADAPTER, "float32")}


async def push_and_generate(target: str) -> tuple[str, str]:
    """Push the adapter, then the greedy text of the question with it and without it, straight from
    the policy server."""
    tensors = adapter_tensors(seed=1)
    async with PolicyClient(target) as client:
        await client.push_weights(tensors, 1, digests=tensor_digests(tensors), adapter=ADAPTER.to_proto())
        texts = []
        for adapter in (ADAPTER.name, ""):
            request = generate_request(messages=[common_pb2.ChatMessage(role=common_pb2.ROLE_USER,
                                                                        content=QUESTION[0]["content"])],
                                       temperature=0.0, max_tokens=16, adapter=adapter)
            group = await client.generate_group(request, timeout_s=120)
            texts.append(group.samples[0].content)
        return texts[0], texts[1]


@pytest.fixture(scope="module")
def direct(tiny_policy: ServerProcess) -> tuple[str, str]:
    return asyncio.run(push_and_generate(tiny_policy.target))


@pytest.fixture(scope="module")
def gateway(tiny_policy: ServerProcess, direct: tuple[str, str]) -> Iterator[ServerProcess]:
    with running_gateway("--policy", tiny_policy.target, "--model-name", "base-alias") as server:
        yield server


def test_models_lists_each_adapter_after_the_served_names(client: openai.OpenAI) -> None:
    names = [model.id for model in client.models.list()]
    assert names[1:] == ["base-alias", ADAPTER.name] and names[0] != ADAPTER.name


def test_a_call_naming_an_adapter_samples_with_it_and_the_served_names_keep_the_base(
        client: openai.OpenAI, direct: tuple[str, str]) -> None:
    with_adapter, base = direct
    assert with_adapter != base, "the adapter does not change the greedy answer; the test would prove nothing"
    answer = client.chat.completions.create(model=ADAPTER.name, messages=QUESTION, temperature=0, max_tokens=16)
    assert answer.choices[0].message.content == with_adapter
    answer = client.chat.completions.create(model="base-alias", messages=QUESTION, temperature=0, max_tokens=16)
    assert answer.choices[0].message.content == base


def test_an_unknown_model_is_a_404_naming_the_adapters_too(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="team-b", messages=QUESTION, max_tokens=4)
    assert "team-b" in str(caught.value) and ADAPTER.name in str(caught.value)
