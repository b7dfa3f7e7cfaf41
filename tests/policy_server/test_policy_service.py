"""PolicyService Generate and Describe against a real `tiny` policy server process."""

from __future__ import annotations

import json

import pytest
import torch
from policy_service_helpers import (
    SEED,
    reference_logprobs,
    reference_model,
    wait_until_idle,
)

from sciproto.client.policy import PolicyClient, generate_request
from sciproto.errors import DeadlineExceeded, InvalidArgument, Reason, Unimplemented
from sciproto.pb import common_pb2, policy_pb2
from sciproto.version import PROTOCOL_VERSION

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = [10, 20, 30, 40]  # greedy decoding of the seed-3 tiny model runs long from here


def user(text: str) -> common_pb2.ChatMessage:
    return common_pb2.ChatMessage(role=common_pb2.ROLE_USER, content=text)


async def test_describe_reports_model_backend_and_capabilities(client: PolicyClient) -> None:
    info = await client.describe()
    assert info.server.protocol_version == PROTOCOL_VERSION
    assert {"generate.chat", "generate.tokens", "weights.grpc_chunks"} <= set(info.server.capabilities)
    assert info.model == f"tiny-qwen2-seed{SEED}"
    assert (info.backend, info.dtype) == ("transformers", policy_pb2.TENSOR_DTYPE_FLOAT32)
    assert info.max_context_tokens == 4096 and info.supports_weight_updates
    assert info.policy_version == 0


async def test_stream_carries_prompt_then_deltas_then_sample_with_exact_logprobs(client: PolicyClient) -> None:
    events = [event async for event in client.generate(generate_request(prompt_token_ids=PROMPT, max_tokens=40,
                                                                        seed=11))]
    kinds = [event.WhichOneof("event") for event in events]
    assert kinds[0] == "prompt" and kinds[-1] == "sample" and "delta" in kinds
    assert list(events[0].prompt.token_ids) == PROMPT
    sample = events[-1].sample
    streamed_ids = [token for e in events if e.HasField("delta") for token in e.delta.token_ids]
    streamed_logprobs = [lp for e in events if e.HasField("delta") for lp in e.delta.logprobs]
    assert streamed_ids == list(sample.completion_token_ids)
    assert streamed_logprobs == list(sample.logprobs)
    assert 0 < len(sample.completion_token_ids) <= 40
    assert [(s.start, s.end, s.policy_version) for s in sample.version_spans] == [
        (0, len(sample.completion_token_ids), 0)]
    expected = reference_logprobs(reference_model().model, PROMPT, sample.completion_token_ids)
    torch.testing.assert_close(torch.tensor(list(sample.logprobs)), expected, atol=1e-4, rtol=0)


async def test_group_of_n_samples_is_reproducible_by_seed(client: PolicyClient) -> None:
    request = generate_request(prompt_token_ids=PROMPT, max_tokens=16, n=5, seed=123)
    first = await client.generate_group(request)
    again = await client.generate_group(request)
    assert [s.sample_index for s in first.samples] == [0, 1, 2, 3, 4]
    assert first.prompt_token_ids == PROMPT
    completions = [list(s.completion_token_ids) for s in first.samples]
    assert len({tuple(c) for c in completions}) > 1  # the samples of a group differ
    assert completions == [list(s.completion_token_ids) for s in again.samples]
    for sample in first.samples:
        assert len(sample.logprobs) == len(sample.completion_token_ids)
        assert sample.finish_reason in (policy_pb2.FINISH_REASON_STOP, policy_pb2.FINISH_REASON_LENGTH)


async def test_multi_turn_prompt_extends_previous_token_ids_exactly(client: PolicyClient) -> None:
    first_turn = [user("What is 2+2?")]
    turn1 = await client.generate_group(generate_request(messages=first_turn, max_tokens=12, seed=5))
    sample = turn1.samples[0]
    previous = turn1.prompt_token_ids + list(sample.completion_token_ids)
    conversation = [*first_turn, common_pb2.ChatMessage(role=common_pb2.ROLE_ASSISTANT, content=sample.text),
                    user("Are you sure?")]
    turn2 = await client.generate_group(generate_request(messages=conversation, previous_token_ids=previous,
                                                         max_tokens=4, seed=5))
    assert turn2.prompt_token_ids[: len(previous)] == previous
    assert len(turn2.prompt_token_ids) > len(previous)


async def test_tools_are_rendered_and_samples_carry_the_tool_call_fields(client: PolicyClient) -> None:
    tool = common_pb2.ToolSpec(name="calculator", description="Evaluates arithmetic",
                               parameters_json_schema=json.dumps({"type": "object",
                                                                  "properties": {"expr": {"type": "string"}}}))
    group = await client.generate_group(generate_request(messages=[user("3*7?")], tools=[tool], max_tokens=8,
                                                         n=2, seed=1))
    prompt_text = bytes(t for t in group.prompt_token_ids if t < 256).decode("utf-8", errors="replace")
    assert "calculator" in prompt_text and "Evaluates arithmetic" in prompt_text
    for sample in group.samples:
        assert isinstance(sample.tool_call_malformed, bool)
        for call in sample.tool_calls:  # a random model rarely calls; when it does, the call is well formed
            assert call.id and call.name and isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize(("request_", "reason", "hint"), [
    (policy_pb2.GenerateRequest(tokens=policy_pb2.TokenPrompt()), Reason.INVALID_REQUEST, "token_ids is empty"),
    (policy_pb2.GenerateRequest(), Reason.INVALID_REQUEST, "no prompt"),
    (generate_request(prompt_token_ids=[1], n=1000), Reason.INVALID_REQUEST, "at most 64"),
    (generate_request(prompt_token_ids=[1] * 4096), Reason.PROMPT_TOO_LONG, "4096 tokens"),
    (generate_request(prompt_token_ids=[1], temperature=-0.5), Reason.INVALID_REQUEST, "temperature"),
    (generate_request(prompt_token_ids=[1], top_p=0.0), Reason.INVALID_REQUEST, "top_p"),
    (generate_request(prompt_token_ids=[1], top_p=1.5), Reason.INVALID_REQUEST, "top_p"),
    (generate_request(prompt_token_ids=[99999]), Reason.INVALID_REQUEST, "outside the vocabulary"),
    (generate_request(messages=[common_pb2.ChatMessage(content="hi")]), Reason.INVALID_REQUEST, "role is unset"),
], ids=["empty-tokens", "no-prompt", "n-too-large", "too-long", "negative-temperature", "top-p-zero",
        "top-p-above-one", "token-out-of-vocab", "role-unspecified"])
async def test_bad_requests_are_invalid_argument_with_a_reason(
        client: PolicyClient, request_: policy_pb2.GenerateRequest, reason: Reason, hint: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        await client.generate_group(request_)
    assert caught.value.reason == reason
    assert hint in caught.value.message


async def test_deadline_stops_the_generation(client: PolicyClient) -> None:
    # 64 greedy samples of ~240 tokens each: far more work than fits in the deadline
    request = generate_request(prompt_token_ids=PROMPT, temperature=0, max_tokens=2000, n=64)
    with pytest.raises(DeadlineExceeded):
        await client.generate_group(request, timeout_s=0.1)
    assert await wait_until_idle(client) == 0


async def test_leaving_the_stream_early_cancels_the_request(client: PolicyClient) -> None:
    stream = client.generate(generate_request(prompt_token_ids=PROMPT, temperature=0, max_tokens=2000, n=4))
    async for event in stream:
        if event.HasField("delta"):
            break
    await stream.aclose()
    assert await wait_until_idle(client) == 0
    # the server still serves after the cancelled call
    group = await client.generate_group(generate_request(prompt_token_ids=PROMPT, max_tokens=4))
    assert len(group.samples) == 1


async def test_image_parts_are_refused_by_a_text_only_model_and_text_parts_are_read(client: PolicyClient) -> None:
    png = b"\x89PNG\r\n\x1a\n" + b"\0" * 16
    with_image = common_pb2.ChatMessage(role=common_pb2.ROLE_USER, content="What does the plot show?", parts=[
        common_pb2.ContentPart(text="What does the plot show?"),
        common_pb2.ContentPart(image=common_pb2.ImagePart(data=png, mime_type="image/png"))])
    with pytest.raises(Unimplemented) as refused:
        await client.generate_group(generate_request(messages=[with_image], max_tokens=2))
    text_parts = common_pb2.ChatMessage(role=common_pb2.ROLE_USER, parts=[common_pb2.ContentPart(text="Say hi.")])
    as_parts = await client.generate_group(generate_request(messages=[text_parts], max_tokens=2, seed=1))
    as_content = await client.generate_group(generate_request(messages=[user("Say hi.")], max_tokens=2, seed=1))
    empty_part = common_pb2.ChatMessage(role=common_pb2.ROLE_USER, parts=[common_pb2.ContentPart()])
    with pytest.raises(InvalidArgument) as empty:
        await client.generate_group(generate_request(messages=[empty_part], max_tokens=2))
    assert empty.value.reason == Reason.INVALID_REQUEST and "parts[0] is empty" in empty.value.message
    assert refused.value.reason == Reason.UNSUPPORTED and "text only" in refused.value.message
    assert refused.value.metadata["part_kinds"] == "image"
    assert as_parts.prompt_token_ids == as_content.prompt_token_ids  # text parts read as the content
