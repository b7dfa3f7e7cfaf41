"""A multi-turn session through the gateway on SmolLM2-135M-Instruct (its real tokenizer and chat
template, from the packaged GGUF file): the recorded calls are one token-faithful sequence, and
each call's new tokens are exactly the re-rendered text of the messages it added."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import httpx
import openai
import pytest

from sciproto.processes import ServerProcess, start_server
from tests.gateway.conftest import serve_gateway


@pytest.fixture(scope="module")
def gateway() -> Iterator[ServerProcess]:
    policy = start_server(["serve", "policy", "--port", "0", "--model", "smollm2", "--set", "dtype=float32"],
                          timeout_s=600, env={"HF_HUB_OFFLINE": "1"})
    try:
        server = serve_gateway("--policy", policy.target)
        try:
            yield server
        finally:
            server.stop()
    finally:
        policy.stop()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_smollm2_session_is_one_token_faithful_sequence(gateway: ServerProcess) -> None:
    from sciproto.models import load_model

    base = f"http://{gateway.target}"
    client = openai.OpenAI(base_url=f"{base}/s/smol/v1", api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    messages: list[dict] = [{"role": "system", "content": "You are a helpful assistant."},
                            {"role": "user", "content": "Name a planet."}]
    for turn in range(3):
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=12, seed=turn)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "Another one?"}]
    calls = httpx.get(f"{base}/sessions/smol", timeout=30).json()["calls"]
    assert [(c["segment"], c["extends"]) for c in calls] == [(0, False), (0, True), (0, True)]
    tokenizer = load_model("smollm2").tokenizer
    first = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert calls[0]["prompt_token_ids"] == tokenizer.encode(first, add_special_tokens=False)
    for before, after in itertools.pairwise(calls):
        sequence = before["prompt_token_ids"] + before["choices"][0]["completion_token_ids"]
        assert after["prompt_token_ids"][: len(sequence)] == sequence
        added = tokenizer.decode(after["prompt_token_ids"][len(sequence):])
        # What follows the last sampled token: the end of turn the template writes when the sample
        # was cut short (finish "length"), its newline, the user's turn, the assistant's header;
        # nothing of the earlier text again.
        closing = "<|im_end|>" if before["choices"][0]["finish_reason"] == "length" else ""
        assert added == f"{closing}\n<|im_start|>user\nAnother one?<|im_end|>\n<|im_start|>assistant\n", added
