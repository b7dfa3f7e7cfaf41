"""Tool calls through the gateway with the `openai` SDK. A random tiny model never writes tool-call
markup, so the test first teaches it one: a few steps of supervised training on the gateway's own
recorded prompt, pushed to the policy server with UpdateWeights. Greedy sampling then writes the
call, the policy server parses it, and the SDK reads it back as `tool_calls`, streamed and not; the
tool's answer continues the session on the same tokens."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest
import torch

from sciproto.client.policy import PolicyClient
from sciproto.models import load_model
from sciproto.processes import ServerProcess
from tests.gateway.conftest import running_gateway

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}}]
QUESTION = [{"role": "user", "content": "What is 2+2?"}]
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'


def teach_tool_call(prompt_ids: list[int], target: str) -> dict[str, torch.Tensor]:
    """The tiny model trained to answer `prompt_ids` with `target` and its end-of-turn token."""
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 64-wide model: more threads only wait on each other
    try:
        return _train(prompt_ids, target)
    finally:
        torch.set_num_threads(threads)


def _train(prompt_ids: list[int], target: str) -> dict[str, torch.Tensor]:
    loaded = load_model("tiny", dtype=torch.float32, seed=3)
    model = loaded.model.train().requires_grad_(True)
    completion = loaded.tokenizer.encode(target, add_special_tokens=False) + [min(loaded.stop_token_ids)]
    ids = torch.tensor([prompt_ids + completion])
    labels = ids.clone()
    labels[0, : len(prompt_ids)] = -100
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(200):
        loss = model(input_ids=ids, labels=labels).loss
        if loss.item() < 0.005:
            break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.05, f"the tiny model did not learn the call (loss {loss.item():.3f})"
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


@pytest.fixture(scope="module")
def gateway(tiny_policy: ServerProcess) -> Iterator[ServerProcess]:
    with running_gateway("--policy", tiny_policy.target) as server:
        base = f"http://{server.target}"
        model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
        probe = {"model": model, "messages": QUESTION, "tools": TOOLS, "max_tokens": 1}
        assert httpx.post(f"{base}/s/probe/v1/chat/completions", json=probe, timeout=120).status_code == 200
        prompt = httpx.get(f"{base}/sessions/probe", timeout=30).json()["calls"][0]["prompt_token_ids"]
        weights = teach_tool_call(prompt, CALL)

        async def push() -> None:
            async with PolicyClient(tiny_policy.target) as policy:
                await policy.push_weights(weights, version=1)

        asyncio.run(push())
        yield server


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_a_tool_call_comes_back_as_tool_calls(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=_model(client), messages=QUESTION, tools=TOOLS, temperature=0,
                                           max_tokens=96)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "calculator" and call.id.startswith("call_")
    assert call.function.arguments == '{"expression": "2+2"}'
    assert choice.message.content is None
    # Without tools the same text is plain content: the markup is the policy's to parse only with tools.
    plain = client.chat.completions.create(model=_model(client), messages=QUESTION, temperature=0, max_tokens=96)
    assert plain.choices[0].finish_reason in ("stop", "length")


def test_streamed_tool_calls_match_the_whole_answer(client: openai.OpenAI) -> None:
    calls: dict[int, dict[str, str]] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(model=_model(client), messages=QUESTION, tools=TOOLS, stream=True,
                                                temperature=0, max_tokens=96):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for piece in choice.delta.tool_calls or []:
                entry = calls.setdefault(piece.index, {"name": "", "arguments": ""})
                entry["name"] += piece.function.name or ""
                entry["arguments"] += piece.function.arguments or ""
    assert (content, finish) == ("", "tool_calls")
    assert calls == {0: {"name": "calculator", "arguments": '{"expression": "2+2"}'}}


def test_the_tool_answer_continues_the_session_on_the_same_tokens(gateway: ServerProcess) -> None:
    base = f"http://{gateway.target}"
    session = openai.OpenAI(base_url=f"{base}/s/tools/v1", api_key="unused", max_retries=0, timeout=120)
    model = _model(session)
    first = session.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS, temperature=0,
                                            max_tokens=96).choices[0].message
    messages = [*QUESTION, first.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "4"}]
    session.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=8)
    calls = httpx.get(f"{base}/sessions/tools", timeout=30).json()["calls"]
    assert [(c["segment"], c["extends"]) for c in calls] == [(0, False), (0, True)]
    sequence = calls[0]["prompt_token_ids"] + calls[0]["choices"][0]["completion_token_ids"]
    assert calls[1]["prompt_token_ids"][: len(sequence)] == sequence
    assert calls[0]["choices"][0]["version_spans"] == [[0, len(calls[0]["choices"][0]["completion_token_ids"]), 1]]


def test_a_responses_function_call_round_trip(gateway: ServerProcess) -> None:
    base = f"http://{gateway.target}"
    session = openai.OpenAI(base_url=f"{base}/s/responses/v1", api_key="unused", max_retries=0, timeout=120)
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    first = session.responses.create(model=_model(session), input=QUESTION, tools=tools, temperature=0,
                                     max_output_tokens=96)
    [call] = [item for item in first.output if item.type == "function_call"]
    assert (call.name, call.arguments) == ("calculator", '{"expression": "2+2"}')
    follow = [*QUESTION, *(item.model_dump(exclude_none=True) for item in first.output),
              {"type": "function_call_output", "call_id": call.call_id, "output": "4"}]
    session.responses.create(model=_model(session), input=follow, tools=tools, max_output_tokens=8)
    calls = httpx.get(f"{base}/sessions/responses", timeout=30).json()["calls"]
    assert [(c["segment"], c["extends"]) for c in calls] == [(0, False), (0, True)]


ANTHROPIC_TOOLS = [{"name": "calculator", "description": "Evaluate arithmetic.",
                    "input_schema": TOOLS[0]["function"]["parameters"]}]
GREEDY = {"temperature": 0}  # a body field the installed SDK no longer lists as an argument


def test_an_anthropic_tool_loop_reaches_a_final_answer_and_its_session_a_group(gateway: ServerProcess) -> None:
    """The official `anthropic` SDK on /v1/messages: the same prompt tokens as the openai SDK's
    (the model trained on those writes the call), a tool_use turn, the tool's result, a final
    answer on the same tokens, and the session closed into a rollout group."""
    base = f"http://{gateway.target}"
    client = anthropic.Anthropic(base_url=f"{base}/s/claude", api_key="unused", max_retries=0, timeout=120)
    model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
    messages: list[dict] = [{"role": "user", "content": "What is 2+2?"}]
    first = client.messages.create(model=model, max_tokens=96, tools=ANTHROPIC_TOOLS, messages=messages,
                                   extra_body=GREEDY)
    assert first.stop_reason == "tool_use" and first.role == "assistant" and first.usage.output_tokens > 0
    [use] = [block for block in first.content if block.type == "tool_use"]
    assert (use.name, use.input) == ("calculator", {"expression": "2+2"})
    answer = first
    for _ in range(3):  # the loop an agent runs: call the tool, send its result, until no tool is asked for
        messages += [{"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in answer.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "4"}
                                                  for block in answer.content if block.type == "tool_use"]}]
        answer = client.messages.create(model=model, max_tokens=8, tools=ANTHROPIC_TOOLS, messages=messages)
        if answer.stop_reason != "tool_use":
            break
    assert answer.stop_reason in ("end_turn", "max_tokens")
    calls = httpx.get(f"{base}/sessions/claude", timeout=30).json()["calls"]
    assert [(c["segment"], c["extends"]) for c in calls] == [(0, False)] + [(0, True)] * (len(calls) - 1)
    sequence = calls[0]["prompt_token_ids"] + calls[0]["choices"][0]["completion_token_ids"]
    assert calls[1]["prompt_token_ids"][: len(sequence)] == sequence
    # The same question through the openai SDK has the same prompt tokens.
    probe = httpx.get(f"{base}/sessions/probe", timeout=30).json()["calls"][0]["prompt_token_ids"]
    assert calls[0]["prompt_token_ids"] == probe

    closed = httpx.post(f"{base}/sessions/claude/close", json={"group": "calc/train/0", "reward": 1.0},
                        timeout=30).json()
    assert closed["records"] == 1 and closed["segments"] == 1
    [record] = httpx.post(f"{base}/groups/calc/train/0/take", timeout=30).json()["records"]
    assert record["steps"] == len(calls) and record["reward"] == 1.0 and sum(record["loss_mask"]) == sum(
        len(c["choices"][0]["completion_token_ids"]) for c in calls)
    assert record["messages"][-1]["role"] == "assistant"


def test_an_anthropic_stream_matches_the_whole_message(gateway: ServerProcess) -> None:
    base = f"http://{gateway.target}"
    client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120)
    model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
    question = [{"role": "user", "content": "What is 2+2?"}]
    for tools in (ANTHROPIC_TOOLS, []):
        whole = client.messages.create(model=model, max_tokens=24, tools=tools, messages=question, extra_body=GREEDY)
        with client.messages.stream(model=model, max_tokens=24, tools=tools, messages=question,
                                    extra_body=GREEDY) as stream:
            text = "".join(stream.text_stream)
            streamed = stream.get_final_message()
        assert [block.model_dump() for block in streamed.content] == [block.model_dump() for block in whole.content]
        assert (streamed.stop_reason, streamed.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
        assert text == "".join(block.text for block in whole.content if block.type == "text")
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.content[0].type == "text"


def test_anthropic_errors_have_its_shape_and_name_its_fields(gateway: ServerProcess) -> None:
    base = f"http://{gateway.target}"
    client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120)
    model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=model, max_tokens=8, messages=[
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": [image]}])
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "invalid_request_error"
    assert "messages[2].content[0]" in caught.value.message and "text only" in caught.value.message
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=model, max_tokens=8, stop_sequences=[""], messages=[{"role": "user",
                                                                                         "content": "hi"}])
    assert "stop_sequences" in caught.value.message
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="no-such-model", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert missing.value.body["error"]["type"] == "not_found_error"
