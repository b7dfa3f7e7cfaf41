"""LoRA adapters in the transformers backend: served outputs equal PEFT's over the same base and
tensors, base rows and rows of two adapters share a batch, per-adapter versions, refused updates,
and the same through a real policy server process."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Iterator, Mapping

import peft
import pytest
import pytest_asyncio
import torch
from policy_service_helpers import SEED, policy_server_process, reference_model

from policy_server.backends.transformers_backend import TransformersBackend
from policy_server.types import GenerationRequest, SampleResult, SamplingParams, TokenDelta
from sciproto.client.policy import PolicyClient, distinct_tensors, generate_request
from sciproto.errors import (
    InvalidArgument,
    NotFound,
    Reason,
    ResourceExhausted,
    SciprotoError,
    from_rpc_error,
)
from sciproto.lora import LoraSpec, adapter_tensor_specs, linear_layers
from sciproto.models import load_model
from sciproto.pb import policy_grpc, policy_pb2
from sciproto.processes import ServerProcess
from sciproto.weights.wire import header_for, set_digest, tensor_digests

ATTENTION = LoraSpec(name="attn", rank=4, alpha=16.0)
MLP = LoraSpec(name="mlp", rank=8, alpha=8.0, target_modules=("q_proj", "v_proj", "gate_proj", "down_proj"))
TOLERANCE = 1e-4
# Prompts of different lengths, so the batch is left-padded. Greedy decoding meets no stop token in
# the first 60 tokens of each on the seed-0 model and the adapters below (seeds 1 and 2), nor in the
# first 100 of the first two on the base and adapter seed 1, so an update reaches running samples.
PROMPTS = [[235, 139, 183, 210], [184, 214, 203, 174, 163], [69, 18, 209, 238, 143, 237]]


def adapter_tensors(spec: LoraSpec, seed: int, base: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Random non-zero A and B (std 0.05) for every tensor of `spec` on `base`."""
    generator = torch.Generator().manual_seed(seed)
    return {tensor.name: torch.randn(tensor.shape, generator=generator) * 0.05
            for tensor in adapter_tensor_specs(linear_layers(base), spec, "float32")}


def peft_model(base_seed: int, spec: LoraSpec, tensors: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """The reference: PEFT's LoRA model over a fresh copy of the base, loaded with `tensors`."""
    model = peft.get_peft_model(reference_model(base_seed).model, spec.peft_config())
    result = peft.set_peft_model_state_dict(model, dict(tensors))
    assert not result.unexpected_keys
    return model.eval()


def greedy_reference(model: torch.nn.Module, prompt: list[int], completion: list[int]
                     ) -> tuple[list[int], torch.Tensor]:
    """The greedy choice after each prefix of the completion, and each completion token's logprob,
    from one full forward pass."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logits.argmax(-1).tolist(), logprobs.gather(1, torch.tensor(completion).unsqueeze(1)).squeeze(1)


def assert_serves(model: torch.nn.Module, prompt: list[int], completion: list[int],
                  logprobs: list[float]) -> float:
    """The served greedy completion is `model`'s, its logprobs within TOLERANCE; returns the largest
    logprob difference."""
    choices, expected = greedy_reference(model, prompt, completion)
    assert completion == choices
    difference = (torch.tensor(list(logprobs)) - expected).abs().max().item()
    assert difference <= TOLERANCE
    return difference


def request(prompt: list[int], adapter: str = "", max_tokens: int = 24, **sampling: object) -> GenerationRequest:
    return GenerationRequest(prompt_token_ids=prompt, adapter=adapter,
                             sampling=SamplingParams(max_tokens=max_tokens, **{"temperature": 0, **sampling}))


async def collect(backend: TransformersBackend, generation: GenerationRequest,
                  started: asyncio.Event | None = None) -> list[SampleResult]:
    results = []
    async for event in backend.generate(generation):
        if isinstance(event, TokenDelta) and started is not None:
            started.set()
        elif isinstance(event, SampleResult):
            results.append(event)
    return sorted(results, key=lambda result: result.sample_index)


@pytest.fixture
def lora_backend() -> Iterator[TransformersBackend]:
    served = TransformersBackend(load_model("tiny", seed=0), stream_interval=4, max_adapters=2, max_adapter_rank=8)
    yield served
    asyncio.run(served.close())


# -- in process ----------------------------------------------------------------------------------


async def test_adapters_serve_what_peft_computes_in_one_mixed_batch(lora_backend: TransformersBackend) -> None:
    backend = lora_backend
    base = reference_model(0).model
    attention, mlp = adapter_tensors(ATTENTION, 1, base), adapter_tensors(MLP, 2, base)
    references = {"": base, "attn": peft_model(0, ATTENTION, attention), "mlp": peft_model(0, MLP, mlp)}
    await backend.update_adapter(ATTENTION, 1, attention)
    assert {name: (state.spec, state.version) for name, state in backend.adapters().items()} == {"attn": (ATTENTION, 1)}
    alone = await collect(backend, request(PROMPTS[0], "attn"))
    await backend.update_adapter(MLP, 5, mlp)
    assert {name: state.version for name, state in backend.adapters().items()} == {"attn": 1, "mlp": 5}
    assert "lora_adapters" in backend.info().capabilities

    routed: list[list[str]] = []  # the adapter of each row of every forward that used one
    routing = backend._lora.routing

    def spy(adapters: list[str]) -> object:
        routed.append(list(adapters))
        return routing(adapters)

    backend._lora.routing = spy  # type: ignore[method-assign]
    calls = [(prompt, adapter) for adapter in ("", "attn", "mlp") for prompt in PROMPTS]
    outcomes = await asyncio.gather(*(collect(backend, request(prompt, adapter)) for prompt, adapter in calls),
                                    collect(backend, request(PROMPTS[1], "mlp", n=2, temperature=1.0, seed=4)))
    assert any({"", "attn", "mlp"} <= set(adapters) for adapters in routed), routed  # one batch held all three
    for (prompt, adapter), (result,) in zip(calls, outcomes):
        assert_serves(references[adapter], prompt, result.completion_token_ids, result.logprobs)
        version = {"": 0, "attn": 1, "mlp": 5}[adapter]
        assert [(span.start, span.end, span.version) for span in result.version_spans] == [(0, 24, version)]
    for result in outcomes[-1]:  # sampled rows of a repeated prompt: PEFT's distribution at temperature 1
        _, expected = greedy_reference(references["mlp"], PROMPTS[1], result.completion_token_ids)
        torch.testing.assert_close(torch.tensor(result.logprobs), expected, atol=TOLERANCE, rtol=0)
    # the second adapter left the first as it was
    assert outcomes[len(PROMPTS)][0].completion_token_ids == alone[0].completion_token_ids
    assert outcomes[len(PROMPTS)][0].logprobs == pytest.approx(alone[0].logprobs, abs=1e-5)
    # the adapters matter: each serves other logprobs than the base (far beyond the tolerance)
    for offset in (len(PROMPTS), 2 * len(PROMPTS)):
        _, base_logprobs = greedy_reference(base, PROMPTS[0], outcomes[offset][0].completion_token_ids)
        assert (torch.tensor(outcomes[offset][0].logprobs) - base_logprobs).abs().max() > 100 * TOLERANCE


async def test_refused_adapter_updates_change_nothing(lora_backend: TransformersBackend) -> None:
    backend = lora_backend
    base = reference_model(0).model
    good = adapter_tensors(ATTENTION, 1, base)
    await backend.update_adapter(ATTENTION, 1, good)
    before = await collect(backend, request(PROMPTS[0], "attn"))
    names = list(good)
    wrong_shape = good | {names[3]: torch.zeros(3, 3)}
    missing = {name: tensor for name, tensor in good.items() if name != names[2]}
    extra = good | {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}
    half = good | {names[1]: good[names[1]].half()}
    for tensors, named in [(wrong_shape, names[3]), (missing, names[2]), (extra, "lm_head"), (half, names[1])]:
        with pytest.raises(ValueError, match=named):
            await backend.update_adapter(ATTENTION, 2, tensors)
    with pytest.raises(ValueError, match="not newer"):
        await backend.update_adapter(ATTENTION, 1, adapter_tensors(ATTENTION, 9, base))
    with pytest.raises(ValueError, match="keeps its shape"):
        await backend.update_adapter(ATTENTION.model_copy(update={"alpha": 8.0}), 2, good)
    with pytest.raises(ValueError, match="rank 16"):
        backend.adapter_manifest(LoraSpec(name="wide", rank=16))
    with pytest.raises(ValueError, match="embed"):
        backend.adapter_manifest(LoraSpec(name="embed", target_modules=("embed_tokens",)))
    await backend.update_adapter(MLP, 1, adapter_tensors(MLP, 2, base))
    with pytest.raises(ValueError, match="max_adapters"):
        await backend.update_adapter(LoraSpec(name="third", rank=2), 1, adapter_tensors(LoraSpec(rank=2), 3, base))
    with pytest.raises(ValueError, match="no adapter named 'nope'"):
        await collect(backend, request(PROMPTS[0], "nope"))
    assert {name: state.version for name, state in backend.adapters().items()} == {"attn": 1, "mlp": 1}
    after = await collect(backend, request(PROMPTS[0], "attn"))
    assert after[0].completion_token_ids == before[0].completion_token_ids
    assert after[0].logprobs == before[0].logprobs
    # the backend copied the tensors: changing the caller's afterwards changes nothing served
    for tensor in good.values():
        tensor.zero_()
    assert (await collect(backend, request(PROMPTS[0], "attn")))[0].logprobs == before[0].logprobs


async def test_versions_are_per_adapter_across_updates_mid_sample(lora_backend: TransformersBackend) -> None:
    backend = lora_backend
    base = reference_model(0).model
    await backend.update_adapter(ATTENTION, 1, adapter_tensors(ATTENTION, 1, base))
    adapters = ["attn", "attn", "", ""]
    started = [asyncio.Event() for _ in adapters]
    calls = [asyncio.create_task(collect(backend, request(PROMPTS[i % 2], adapter, max_tokens=100), event))
             for i, (adapter, event) in enumerate(zip(adapters, started, strict=True))]
    await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 60)
    replacement = adapter_tensors(ATTENTION, 7, base)
    await backend.update_adapter(ATTENTION, 2, replacement)
    await backend.update_weights(3, distinct_tensors(reference_model(1).model.state_dict()))
    outcomes = await asyncio.wait_for(asyncio.gather(*calls), 120)
    for adapter, (result,) in zip(adapters, outcomes, strict=True):
        spans = [(span.start, span.end, span.version) for span in result.version_spans]
        assert spans[0][0] == 0 and spans[-1][1] == len(result.completion_token_ids)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
        # an adapter sample's spans follow its adapter's versions and no base update; a base one's the base's
        assert [version for *_, version in spans] == ([1, 2] if adapter else [0, 3]), (adapter, spans)
    assert backend.adapters()["attn"].version == 2 and backend.info().policy_version == 3
    # a new sample of the adapter is the replacement over the new base weights
    (result,) = await collect(backend, request(PROMPTS[2], "attn"))
    assert_serves(peft_model(1, ATTENTION, replacement), PROMPTS[2], result.completion_token_ids, result.logprobs)



async def test_an_adapter_update_that_timed_out_for_its_caller_is_never_applied() -> None:
    backend = TransformersBackend(load_model("tiny", seed=0), stall_timeout_s=0.5)
    try:
        backend._engine_lock.acquire()  # the engine is busy past the caller's wait
        try:
            with pytest.raises(TimeoutError):
                await backend.update_adapter(ATTENTION, 1, adapter_tensors(ATTENTION, 1, reference_model(0).model))
        finally:
            backend._engine_lock.release()
        for _ in range(100):  # the engine reaches the withdrawn update
            if not backend._inbox.qsize():
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        assert backend.adapters() == {}
        with pytest.raises(ValueError, match="no adapter named 'attn'"):
            await collect(backend, request(PROMPTS[0], "attn"))
    finally:
        await backend.close()


# -- through a policy server ---------------------------------------------------------------------


SERVED = LoraSpec(name="served", rank=4, alpha=8.0, target_modules=("q_proj", "o_proj", "up_proj"))
GREEDY_PROMPT = [10, 20, 30, 40]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    yield from policy_server_process("--set", "adapters.max_adapters=2", "--set", "adapters.max_rank=8")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def served(server: ServerProcess) -> AsyncIterator[dict[str, torch.Tensor]]:
    """SERVED pushed at version 1, with its tensors' digests."""
    tensors = adapter_tensors(SERVED, 11, reference_model().model)
    async with PolicyClient(server.target) as client:
        result = await client.push_weights(tensors, 1, digests=tensor_digests(tensors), adapter=SERVED.to_proto())
    assert result.policy_version == 1
    yield tensors


async def raw_update(client: PolicyClient, header: policy_pb2.WeightsHeader, chunks: list[bytes]) -> None:
    """An UpdateWeights stream exactly as given."""
    async def messages() -> AsyncIterator[policy_pb2.UpdateWeightsRequest]:
        yield policy_pb2.UpdateWeightsRequest(header=header)
        for chunk in chunks:
            yield policy_pb2.UpdateWeightsRequest(data=chunk)
    try:
        await policy_grpc.PolicyServiceStub(client.channel).UpdateWeights(messages(), timeout=30)
    except Exception as error:
        raise from_rpc_error(error) from error


@pytest.mark.asyncio(loop_scope="module")
async def test_server_serves_a_pushed_adapter_and_refuses_a_corrupted_one(
        client: PolicyClient, served: dict[str, torch.Tensor]) -> None:
    describe = await client.describe()
    (serving,) = describe.adapters
    assert (serving.adapter.name, serving.adapter.rank, serving.policy_version) == ("served", 4, 1)
    assert serving.weights_digest == set_digest(tensor_digests(served))
    assert (describe.max_adapters, describe.max_adapter_rank, describe.policy_version) == (2, 8, 0)
    assert "backend.lora_adapters" in describe.server.capabilities
    greedy = generate_request(prompt_token_ids=GREEDY_PROMPT, temperature=0, max_tokens=24, adapter="served")
    before = await client.generate_group(greedy)
    assert before.policy_version == 1
    sample = before.samples[0]
    assert [(span.policy_version) for span in sample.version_spans] == [1]
    assert_serves(peft_model(SEED, SERVED, served), GREEDY_PROMPT, list(sample.completion_token_ids),
                  list(sample.logprobs))
    base = await client.generate_group(generate_request(prompt_token_ids=GREEDY_PROMPT, temperature=0, max_tokens=24))
    assert_serves(reference_model().model, GREEDY_PROMPT, list(base.samples[0].completion_token_ids),
                  list(base.samples[0].logprobs))

    # version 2 whose second tensor's bytes were altered after its digest was taken
    update = adapter_tensors(SERVED, 12, reference_model().model)
    header = header_for(update, 2, digests=tensor_digests(update))
    header.adapter.CopyFrom(SERVED.to_proto())
    data = bytearray(b"".join(tensor.numpy().tobytes() for tensor in update.values()))
    first, second = list(update)[:2]
    data[update[first].numel() * 4 + 5] ^= 0x40  # a byte of the second tensor
    with pytest.raises(InvalidArgument) as caught:
        await raw_update(client, header, [bytes(data)])
    assert caught.value.reason == Reason.INVALID_WEIGHTS and caught.value.metadata["tensor"] == second
    (serving,) = (await client.describe()).adapters
    assert serving.policy_version == 1 and serving.weights_digest == set_digest(tensor_digests(served))
    after = await client.generate_group(greedy)
    assert list(after.samples[0].completion_token_ids) == list(sample.completion_token_ids)
    assert list(after.samples[0].logprobs) == list(sample.logprobs)


@pytest.mark.asyncio(loop_scope="module")
async def test_server_refuses_adapters_past_its_limit_and_unknown_names(
        client: PolicyClient, served: dict[str, torch.Tensor]) -> None:
    with pytest.raises(NotFound) as caught:
        await client.generate_group(generate_request(prompt_token_ids=GREEDY_PROMPT, max_tokens=4, adapter="nope"))
    assert caught.value.reason == Reason.UNKNOWN_ADAPTER and "served" in caught.value.message
    base = reference_model().model
    for name in ("second", "third"):
        spec = LoraSpec(name=name, rank=2, target_modules=("v_proj",))
        tensors = adapter_tensors(spec, 13, base)
        push = client.push_weights(tensors, 1, digests=tensor_digests(tensors), adapter=spec.to_proto())
        if name == "second":
            await push
            continue
        with pytest.raises(SciprotoError) as refused:
            await push
        assert isinstance(refused.value, ResourceExhausted) and refused.value.reason == Reason.TOO_MANY_ADAPTERS
    assert sorted(adapter.adapter.name for adapter in (await client.describe()).adapters) == ["second", "served"]


@pytest.mark.asyncio(loop_scope="module")
async def test_updates_of_two_adapters_at_once_both_apply(
        client: PolicyClient, served: dict[str, torch.Tensor]) -> None:
    """Two training runs share a policy server, each pushing its own adapter: a push of one adapter
    that meets the other's still being received waits its turn instead of being refused."""
    base = reference_model().model
    held_spec = LoraSpec(name="second", rank=2, target_modules=("v_proj",))  # "second": already loaded
    version = next(a.policy_version for a in (await client.describe()).adapters if a.adapter.name == "second") + 1
    held = adapter_tensors(held_spec, 14, base)
    header = header_for(held, version, digests=tensor_digests(held))
    header.adapter.CopyFrom(held_spec.to_proto())
    release = asyncio.Event()

    async def messages() -> AsyncIterator[policy_pb2.UpdateWeightsRequest]:
        yield policy_pb2.UpdateWeightsRequest(header=header)
        await release.wait()  # the server holds this update open, waiting for its data
        yield policy_pb2.UpdateWeightsRequest(data=b"".join(t.numpy().tobytes() for t in held.values()))

    stub = policy_grpc.PolicyServiceStub(client.channel)
    held_update = asyncio.ensure_future(stub.UpdateWeights(messages(), timeout=60))
    try:
        await asyncio.sleep(1.0)  # its header is in
        served_version = next(a.policy_version for a in (await client.describe()).adapters
                              if a.adapter.name == "served")
        update = adapter_tensors(SERVED, 15, base)
        other = asyncio.ensure_future(client.push_weights(update, served_version + 1, digests=tensor_digests(update),
                                                          adapter=SERVED.to_proto(), timeout_s=60))
        await asyncio.wait([other], timeout=2.0)
    finally:
        release.set()  # never leave the held update open on the module's server
    assert (await held_update).policy_version == version
    assert (await other).policy_version == served_version + 1
    described = {a.adapter.name: a for a in (await client.describe()).adapters}
    assert described["served"].weights_digest == set_digest(tensor_digests(update))
    assert described["second"].weights_digest == set_digest(tensor_digests(held))
