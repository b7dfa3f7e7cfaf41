import asyncio
import functools
import itertools
import operator

import pytest
import torch

from policy_server.types import (
    ChatMessage,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    VersionSpan,
)


def _request(text="hello", **sampling) -> GenerationRequest:
    return GenerationRequest(
        messages=[ChatMessage("user", text)], sampling=SamplingParams(**sampling)
    )


def _full_forward_logprobs(model, prompt, completion, temperature=1.0):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    logq = torch.log_softmax(logits / temperature, dim=-1)
    return logq.gather(1, torch.tensor(completion).unsqueeze(1)).squeeze(1)


async def test_logprobs_match_a_full_forward_pass_while_batched(collect, backend, tiny):
    # different prompt lengths in one batch exercise left padding and per-row positions
    requests = [_request("hi" * (i + 1), max_tokens=24, seed=i) for i in range(4)]
    outcomes = await asyncio.gather(*(collect(backend, r) for r in requests))
    for results, _ in outcomes:
        (result,) = results
        expected = _full_forward_logprobs(
            tiny.model, result.prompt_token_ids, result.completion_token_ids
        )
        assert torch.allclose(torch.tensor(result.logprobs), expected, atol=1e-4)


async def test_processed_logprobs_at_temperature(collect, backend, tiny):
    (result,), _ = await collect(backend, _request(max_tokens=16, seed=5, temperature=0.6))
    expected = _full_forward_logprobs(
        tiny.model, result.prompt_token_ids, result.completion_token_ids, 0.6
    )
    assert torch.allclose(torch.tensor(result.logprobs), expected, atol=1e-4)


async def test_n_samples_share_the_prompt_and_differ(collect, backend):
    results, deltas = await collect(backend, _request(max_tokens=12, seed=1, n=4))
    assert [r.sample_index for r in results] == [0, 1, 2, 3]
    assert len({tuple(r.prompt_token_ids) for r in results}) == 1
    assert len({tuple(r.completion_token_ids) for r in results}) > 1
    for result in results:  # the deltas of a sample add up to its result
        mine = [d for d in deltas if d.sample_index == result.sample_index]
        assert (
            functools.reduce(operator.iadd, (d.token_ids for d in mine), [])
            == result.completion_token_ids
        )
        assert "".join(d.text for d in mine) == result.text
        assert result.version_spans == [VersionSpan(0, len(result.completion_token_ids), 0)]


async def test_same_seed_same_sample_alone_or_batched(collect, backend):
    alone, _ = await collect(
        backend, _request("abc", max_tokens=20, seed=42, n=2, temperature=0.9, top_p=0.9)
    )
    crowd = [_request("x" * i, max_tokens=5 + i, seed=i) for i in range(6)]
    outcomes = await asyncio.gather(
        *(collect(backend, r) for r in crowd[:3]),
        collect(backend, _request("abc", max_tokens=20, seed=42, n=2, temperature=0.9, top_p=0.9)),
        *(collect(backend, r) for r in crowd[3:]),
    )
    batched, _ = outcomes[3]
    assert [r.completion_token_ids for r in batched] == [r.completion_token_ids for r in alone]
    for mine, reference in zip(batched, alone):
        assert mine.logprobs == pytest.approx(reference.logprobs, abs=1e-5)


async def test_multi_turn_extends_previous_token_ids_exactly(collect, backend, tiny):
    first = GenerationRequest(
        messages=[ChatMessage("user", "hi")], sampling=SamplingParams(max_tokens=10, seed=3)
    )
    (turn1,), _ = await collect(backend, first)
    previous = turn1.prompt_token_ids + turn1.completion_token_ids
    messages = [
        ChatMessage("user", "hi"),
        ChatMessage("assistant", "re-rendered differently"),
        ChatMessage("tool", "42", tool_call_id="c1"),
    ]
    second = GenerationRequest(
        messages=messages,
        previous_token_ids=previous,
        sampling=SamplingParams(max_tokens=5, seed=3),
    )
    (turn2,), _ = await collect(backend, second)
    assert turn2.prompt_token_ids[: len(previous)] == previous
    suffix = tiny.tokenizer.decode(turn2.prompt_token_ids[len(previous) :])
    # a sample cut off by max_tokens gets the template's closing <|im_end|> appended
    closing = "" if turn1.finish_reason is FinishReason.STOP else "<|im_end|>"
    assert (
        suffix
        == closing
        + "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


async def test_multi_turn_after_a_stop_token_does_not_repeat_it(collect, backend, tiny):
    im_end = tiny.tokenizer.convert_tokens_to_ids("<|im_end|>")
    previous = tiny.tokenizer.encode(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo", add_special_tokens=False
    ) + [im_end]
    messages = [
        ChatMessage("user", "hi"),
        ChatMessage("assistant", "yo"),
        ChatMessage("user", "again"),
    ]
    (result,), _ = await collect(
        backend,
        GenerationRequest(
            messages=messages, previous_token_ids=previous, sampling=SamplingParams(max_tokens=2)
        ),
    )
    full = tiny.tokenizer.apply_chat_template(
        [m.to_template_dict() for m in messages], tokenize=False, add_generation_prompt=True
    )
    assert result.prompt_token_ids == tiny.tokenizer.encode(full, add_special_tokens=False)


async def test_stop_strings_and_stop_tokens_end_samples(collect, backend, tiny):
    results, deltas = await collect(
        backend, _request(max_tokens=64, seed=0, n=8, stop=["a", "e", "o", "\n"])
    )
    stopped = [r for r in results if r.finish_reason is FinishReason.STOP]
    assert stopped, "a random byte model hits one of four common bytes within 64 tokens"
    for result in stopped:
        full_text = tiny.tokenizer.decode(result.completion_token_ids)
        assert not any(s in result.text for s in ["a", "e", "o", "\n"])
        assert full_text.startswith(result.text) and len(full_text) > len(result.text)
        assert (
            "".join(d.text for d in deltas if d.sample_index == result.sample_index) == result.text
        )


async def test_weight_update_changes_outputs_and_version(collect, backend):
    request = _request(max_tokens=16, seed=7)
    (before,), _ = await collect(backend, request)
    generator = torch.Generator().manual_seed(11)  # the same new weights whatever ran before
    new_weights = {
        s.name: torch.randn(s.shape, generator=generator) * 0.3 for s in backend.weight_manifest()
    }
    await backend.update_weights(1, new_weights)
    (after,), _ = await collect(backend, request)
    assert backend.info().policy_version == 1
    assert after.completion_token_ids != before.completion_token_ids
    # the sample may end early on a stop token; whatever its length, version 1 made all of it
    assert after.version_spans == [VersionSpan(0, len(after.completion_token_ids), 1)]


@pytest.mark.parametrize("break_it", ["missing", "extra", "shape", "dtype"])
async def test_wrong_manifest_is_refused_and_old_weights_still_serve(collect, backend, break_it):
    request = _request(max_tokens=8, seed=7)
    (before,), _ = await collect(backend, request)
    manifest = backend.weight_manifest()
    tensors = {s.name: torch.zeros(s.shape) for s in manifest}
    victim = manifest[3].name
    if break_it == "missing":
        del tensors[victim]
    elif break_it == "extra":
        tensors["lm_head.extra"] = torch.zeros(1)
        victim = "lm_head.extra"
    elif break_it == "shape":
        tensors[victim] = torch.zeros(7)
    else:
        tensors[victim] = tensors[victim].double()
    with pytest.raises(ValueError, match=victim):
        await backend.update_weights(1, tensors)
    (after,), _ = await collect(backend, request)
    assert backend.info().policy_version == 0
    assert after.completion_token_ids == before.completion_token_ids


async def test_concurrent_generates_during_an_update_finish_with_version_spans(collect, backend):
    new_weights = {s.name: torch.randn(s.shape) * 0.3 for s in backend.weight_manifest()}
    generations = [
        asyncio.create_task(collect(backend, _request("q" * i, max_tokens=200, seed=i, n=2)))
        for i in range(1, 5)
    ]
    while not any(getattr(row, "tokens", None) for row in backend._rows):
        await asyncio.sleep(0.001)
    await backend.update_weights(3, new_weights)
    straddled = 0
    for results, _ in await asyncio.gather(*generations):
        for result in results:
            spans = result.version_spans
            assert spans[0].start == 0 and spans[-1].end == len(result.completion_token_ids)
            assert all(a.end == b.start for a, b in itertools.pairwise(spans))
            assert [s.version for s in spans] in ([0], [3], [0, 3])
            straddled += len(spans) == 2
    assert straddled > 0


async def test_leaving_early_cancels_the_sample(collect, backend):
    stream = backend.generate(_request(max_tokens=500, seed=1))
    first = await anext(stream)
    await stream.aclose()
    assert first.token_ids
    (result,), _ = await collect(backend, _request(max_tokens=4, seed=1))
    assert result.finish_reason is FinishReason.LENGTH


async def test_bad_requests_say_what_to_fix(collect, backend):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        await anext(backend.generate(GenerationRequest(prompt_token_ids=[10**6])))
    with pytest.raises(ValueError, match="context"):
        await anext(backend.generate(GenerationRequest(prompt_token_ids=[1] * 5000)))
    with pytest.raises(ValueError, match="no assistant turn"):
        await anext(
            backend.generate(
                GenerationRequest(messages=[ChatMessage("user", "x")], previous_token_ids=[1])
            )
        )
