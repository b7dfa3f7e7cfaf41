"""The official `openai` SDK against `sciproto serve gateway` on a tiny policy server, each in its
own process: completions, streaming, n, logprobs, and OpenAI's error shapes; and the limits that
keep one request (a 30 MB body, a 10 MB prompt) from holding up the others."""

from __future__ import annotations

import http.client
import json
import statistics
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from sciproto.processes import ServerProcess
from tests.gateway.conftest import running_gateway

QUESTION = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}]
BODY_LIMIT = 16_000_000  # above the 10 MB prompt of the limits tests, below their 30 MB body
SMALL = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def gateway(tiny_policy: ServerProcess) -> Iterator[ServerProcess]:
    with running_gateway("--policy", tiny_policy.target, "--model-name", "my-agent-model",
                         "--max-request-bytes", str(BODY_LIMIT)) as server:
        yield server


def test_models_lists_the_served_model_and_its_alias(client: openai.OpenAI) -> None:
    names = [model.id for model in client.models.list()]
    assert names[1:] == ["my-agent-model"] and names[0]


def test_streamed_deltas_add_up_to_the_answer_with_the_same_seed(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="my-agent-model", messages=QUESTION, seed=11, max_tokens=24,
                                           temperature=1.0)
    stream = client.chat.completions.create(model="my-agent-model", messages=QUESTION, seed=11, max_tokens=24,
                                            temperature=1.0, stream=True, stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    answer = whole.choices[0]
    assert "".join(pieces) == answer.message.content and answer.message.content
    assert finish == answer.finish_reason in ("stop", "length")
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens > 0
    assert usage.prompt_tokens == whole.usage.prompt_tokens > 0


def test_n_samples_and_logprobs(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="my-agent-model", messages=QUESTION, n=3, max_tokens=8, seed=5,
                                           logprobs=True)
    assert [choice.index for choice in reply.choices] == [0, 1, 2]
    entries = [choice.logprobs.content for choice in reply.choices]
    assert reply.usage.completion_tokens == sum(len(e) for e in entries)
    assert all(entry.logprob <= 0 and entry.token.startswith("token_id:") for e in entries for entry in e)
    assert len({tuple(entry.token for entry in e) for e in entries}) > 1  # three samples, not one thrice


def test_unknown_model_is_a_404_in_openai_shape(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-9", messages=QUESTION)
    assert caught.value.code == "model_not_found" and "my-agent-model" in caught.value.message


def test_malformed_tools_are_a_400_naming_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="my-agent-model", messages=QUESTION,
                                       tools=[{"type": "function", "function": {"description": "no name"}}])
    assert caught.value.param == "tools[0]" and caught.value.code == "invalid_tools"


def test_too_many_tokens_is_context_length_exceeded(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="my-agent-model", messages=QUESTION, max_tokens=10_000_000)
    assert caught.value.code == "context_length_exceeded" and caught.value.param == "max_tokens"
    long = [{"role": "user", "content": "word " * 200_000}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="my-agent-model", messages=long, max_tokens=4)
    assert caught.value.code == "context_length_exceeded" and caught.value.param == "messages"


def test_unsupported_sampling_options_are_refused_not_ignored(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="my-agent-model", messages=QUESTION, presence_penalty=1.0)
    assert caught.value.param == "presence_penalty"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="my-agent-model", messages=QUESTION, logprobs=True, top_logprobs=5)
    assert caught.value.param == "top_logprobs"


def test_top_p_zero_is_refused_naming_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="my-agent-model", messages=QUESTION, top_p=0)
    assert caught.value.param == "top_p" and "(0, 1]" in caught.value.message


def test_a_body_that_is_not_json_gets_an_error_object(gateway: ServerProcess) -> None:
    response = httpx.post(f"http://{gateway.target}/v1/chat/completions", content=b"{not json", timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    response = httpx.get(f"http://{gateway.target}/v1/nothing", timeout=30)
    assert response.status_code == 404 and "base URL" in response.json()["error"]["message"]
    # The anthropic SDK given the openai SDK's base URL: told which routes exist.
    response = httpx.post(f"http://{gateway.target}/s/x/v1/v1/messages", json={}, timeout=30)
    assert response.status_code == 404 and "/v1/messages" in response.json()["error"]["message"]


def test_the_responses_api_answers_and_streams_the_same_text(client: openai.OpenAI) -> None:
    whole = client.responses.create(model="my-agent-model", instructions="You are terse.", input="What is 2+2?",
                                    max_output_tokens=16, temperature=1.0, extra_body={"seed": 4})
    assert whole.output_text and whole.usage.output_tokens > 0 and whole.status in ("completed", "incomplete")
    deltas, final = [], None
    for event in client.responses.create(model="my-agent-model", instructions="You are terse.",
                                         input="What is 2+2?", max_output_tokens=16, temperature=1.0,
                                         extra_body={"seed": 4}, stream=True):
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        elif event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert "".join(deltas) == whole.output_text == final.output_text
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="my-agent-model", input="hi", previous_response_id="resp_1")
    assert caught.value.param == "previous_response_id"


def test_responses_errors_name_the_responses_fields(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="my-agent-model", input="hi", max_output_tokens=10_000_000)
    assert caught.value.code == "context_length_exceeded" and caught.value.param == "max_output_tokens"
    assert "max_output_tokens" in caught.value.message and "max_tokens" not in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="my-agent-model", instructions="Be terse.",
                                input=[{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}])
    assert caught.value.param == "input[1].role" and "messages" not in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="my-agent-model", input="hi",
                                tools=[{"type": "function", "name": "f", "parameters": "not a schema"}])
    assert caught.value.param == "tools[0].parameters" and "function." not in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="my-agent-model", input="word " * 200_000, max_output_tokens=4)
    assert caught.value.code == "context_length_exceeded" and caught.value.param == "input"


# -- Limits that keep one request from stalling the others: a body past the gateway's limit is
# refused (413) before it is read whole; a prompt that cannot fit the context is refused (400,
# context_length_exceeded) before the policy server tokenizes it; and the small requests sent
# beside either answer about as fast as they did alone.

@pytest.fixture(scope="module")
def base(gateway: ServerProcess) -> str:
    return f"http://{gateway.target}"


@pytest.fixture(scope="module")
def model(base: str) -> str:
    return httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]


def small_latency(base: str, model: str) -> float:
    started = time.perf_counter()
    reply = httpx.post(f"{base}/v1/chat/completions", json={"model": model, **SMALL}, timeout=120)
    assert reply.status_code == 200, reply.text
    return time.perf_counter() - started


def beside(base: str, model: str, big: Callable[[], httpx.Response]) -> tuple[httpx.Response, list[float], float]:
    """The big request's answer, the latencies of small requests sent one after another while it
    was in flight (at least three), and the median latency of small requests sent alone before."""
    for _ in range(2):
        small_latency(base, model)  # warm: connections, the model's first steps
    alone = statistics.median(small_latency(base, model) for _ in range(7))
    answer: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: answer.append(big()), daemon=True)
    thread.start()
    during: list[float] = []
    while thread.is_alive() or len(during) < 3:
        during.append(small_latency(base, model))
    thread.join(timeout=120)
    assert answer, "the big request did not finish"
    return answer[0], during, alone


def assert_not_held_up(during: list[float], alone: float) -> None:
    # The machine is shared: a median within twice the latency alone, plus 0.2 s of slack for
    # noise. A request held up behind the big one waits for all of it (seconds, as before the fix).
    assert statistics.median(during) <= 2 * alone + 0.2, (
        f"small requests took {statistics.median(during):.3f} s (median of {len(during)}) beside the big one, "
        f"{alone:.3f} s alone")


def test_a_body_past_the_limit_is_refused_before_it_is_read(gateway: ServerProcess, base: str, model: str) -> None:
    # A 30 MB body announced by its Content-Length, of which only the first 64 kB is sent: the
    # 413 comes back with the rest unsent (so unread), and a small request sent while the big
    # one is still open is answered meanwhile.
    head = b'{"model": "%s", "messages": [{"role": "user", "content": "' % model.encode()
    host, port = gateway.target.rsplit(":", 1)
    big = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        big.putrequest("POST", "/v1/chat/completions")
        big.putheader("Content-Type", "application/json")
        big.putheader("Content-Length", str(len(head) + 30_000_000 + 4))
        big.endheaders(head + b"a" * 65_536)
        small_latency(base, model)
        reply = big.getresponse()
        status, error = reply.status, json.loads(reply.read())["error"]
    finally:
        big.close()
    assert status == 413, error
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
    assert str(BODY_LIMIT) in error["message"] and "--max-request-bytes" in error["message"]


def test_a_chunked_body_past_the_limit_is_refused_too(base: str, model: str) -> None:
    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit applies while reading
        yield b'{"model": "%s", "messages": [{"role": "user", "content": "' % model.encode()
        for _ in range(30):
            yield b"a" * 1_000_000
        yield b'"}]}'

    reply = httpx.post(f"{base}/v1/chat/completions", content=chunks(),
                       headers={"Content-Type": "application/json"}, timeout=120)
    assert reply.status_code == 413, reply.text[:300]
    error = reply.json()["error"]
    assert error["code"] == "request_too_large", error
    assert f"passed {BODY_LIMIT} bytes" in error["message"] and "--max-request-bytes" in error["message"]


def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(base: str, model: str) -> None:
    prompt = {"model": model, "messages": [{"role": "user", "content": "word " * 2_000_000}], "max_tokens": 4}
    reply, during, alone = beside(base, model, lambda: httpx.post(f"{base}/v1/chat/completions", json=prompt,
                                                                   timeout=120))
    assert reply.status_code == 400, reply.text[:300]
    error = reply.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert "10000000 characters" in error["message"] and "4096 tokens" in error["message"]
    assert_not_held_up(during, alone)
