"""UpdateWeights against a real `tiny` policy server process: in-place updates, refused updates
that leave the old weights serving, and generation running across a swap."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from collections.abc import AsyncIterator, Mapping

import pytest
import torch
from policy_service_helpers import SEED, reference_logprobs, reference_model

from sciproto.client.policy import (
    PolicyClient,
    distinct_tensors,
    generate_request,
    push_weights_to_all,
)
from sciproto.errors import (
    FailedPrecondition,
    InvalidArgument,
    Reason,
    SciprotoError,
    from_rpc_error,
)
from sciproto.pb import policy_grpc, policy_pb2
from sciproto.processes import ServerProcess
from sciproto.weights.wire import header_for, weights_sha256

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = [10, 20, 30, 40]
GREEDY = generate_request(prompt_token_ids=PROMPT, temperature=0, max_tokens=32)


def parameters_of_seed(seed: int) -> dict[str, torch.Tensor]:
    return distinct_tensors(reference_model(seed).model.state_dict())


async def raw_update(client: PolicyClient, header: policy_pb2.WeightsHeader, chunks: list[bytes]) -> None:
    """An UpdateWeights stream exactly as given, bypassing the client's own checks."""
    async def messages() -> AsyncIterator[policy_pb2.UpdateWeightsRequest]:
        yield policy_pb2.UpdateWeightsRequest(header=header)
        for chunk in chunks:
            yield policy_pb2.UpdateWeightsRequest(data=chunk)
    try:
        await policy_grpc.PolicyServiceStub(client.channel).UpdateWeights(messages(), timeout=30)
    except Exception as error:
        raise from_rpc_error(error) from error


def corrupt_updates(version: int) -> dict[str, tuple[policy_pb2.WeightsHeader, list[bytes], Reason]]:
    good = parameters_of_seed(SEED + 100)
    names = list(good)
    header, data = header_for(good, version), b"".join(t.numpy().tobytes() for t in good.values())
    wrong_shape = dict(good) | {names[1]: torch.zeros(3, 3)}
    missing = {name: t for name, t in good.items() if name != names[2]}
    extra = dict(good) | {"extra.weight": torch.zeros(4)}
    half = {name: t.half() if name == names[3] else t for name, t in good.items()}
    return {
        "wrong-shape": (header_for(wrong_shape, version), [data], Reason.INVALID_WEIGHTS),
        "missing-tensor": (header_for(missing, version), [data], Reason.INVALID_WEIGHTS),
        "extra-tensor": (header_for(extra, version), [data], Reason.INVALID_WEIGHTS),
        "wrong-dtype": (header_for(half, version), [data], Reason.INVALID_WEIGHTS),
        "truncated": (header, [data[: len(data) // 2]], Reason.WEIGHTS_INCOMPLETE),
        "extra-bytes": (header, [data, b"\0" * 8], Reason.WEIGHTS_INCOMPLETE),
        "stale-version": (header_for(good, 0), [data], Reason.STALE_VERSION),
    }


async def test_corrupt_updates_are_refused_and_the_old_weights_keep_serving(client: PolicyClient) -> None:
    before = await client.generate_group(GREEDY)
    version = (await client.describe()).policy_version
    for case, (header, chunks, reason) in corrupt_updates(version + 1).items():
        with pytest.raises(SciprotoError) as caught:
            await raw_update(client, header, chunks)
        assert caught.value.reason == reason, case
        expected_type = FailedPrecondition if reason == Reason.STALE_VERSION else InvalidArgument
        assert isinstance(caught.value, expected_type), case
        if reason == Reason.INVALID_WEIGHTS:
            assert caught.value.metadata["tensor"] in caught.value.message, case
    assert (await client.describe()).policy_version == version
    after = await client.generate_group(GREEDY)
    assert list(after.samples[0].completion_token_ids) == list(before.samples[0].completion_token_ids)
    assert list(after.samples[0].logprobs) == list(before.samples[0].logprobs)


async def test_a_refused_update_reports_its_reason_while_chunks_are_still_in_flight(client: PolicyClient) -> None:
    """A header refused before its data has arrived: the server's reason must reach the client even
    though the client is still writing chunks. grpcio's asyncio client replaces the server's status
    with INTERNAL ("Internal error from Core") when a write fails because the server had already
    ended the call (grpc/grpc#36066): with 8 MiB in 1 MiB chunks behind a refused header, about a
    quarter of the tries met it on two cores (until the server read the rest of a refused stream)."""
    version = (await client.describe()).policy_version
    header, (data,), _ = corrupt_updates(version + 1)["wrong-dtype"]
    data = (data * (8 * 2**20 // len(data) + 1))[: 8 * 2**20]
    chunks = [data[at:at + 2**20] for at in range(0, len(data), 2**20)]
    reasons = []
    for _ in range(100):
        with pytest.raises(SciprotoError) as caught:
            await raw_update(client, header, chunks)
        reasons.append(caught.value.reason)
    assert reasons == [Reason.INVALID_WEIGHTS] * len(reasons), {r: reasons.count(r) for r in set(reasons)}
    assert (await client.describe()).policy_version == version


async def test_update_changes_outputs_and_version(client: PolicyClient) -> None:
    before = await client.generate_group(GREEDY)
    version = (await client.describe()).policy_version + 1
    new_seed = SEED + 1
    weights = parameters_of_seed(new_seed)
    result = await client.push_weights(weights, version, chunk_bytes=10_000)  # many chunks, split across tensors
    assert result.policy_version == version
    assert result.bytes_received == sum(t.numel() * t.element_size() for t in weights.values())
    assert (await client.describe()).policy_version == version
    after = await client.generate_group(GREEDY)
    assert after.policy_version == version
    sample = after.samples[0]
    assert list(sample.completion_token_ids) != list(before.samples[0].completion_token_ids)
    assert [(s.policy_version) for s in sample.version_spans] == [version]
    # the bytes arrived intact: the served model is now exactly the seed-4 model
    sampled = generate_request(prompt_token_ids=PROMPT, max_tokens=24, seed=9)
    sample = (await client.generate_group(sampled)).samples[0]
    expected = reference_logprobs(reference_model(new_seed).model, PROMPT, sample.completion_token_ids)
    torch.testing.assert_close(torch.tensor(list(sample.logprobs)), expected, atol=1e-4, rtol=0)


async def test_generation_runs_across_an_update(client: PolicyClient) -> None:
    version = (await client.describe()).policy_version
    request = generate_request(prompt_token_ids=PROMPT, temperature=0, max_tokens=1500, n=2)
    started = [asyncio.Event() for _ in range(6)]

    async def collect(started: asyncio.Event) -> list[policy_pb2.GenerateSample]:
        samples = []
        async for event in client.generate(request, timeout_s=120):
            if event.HasField("delta"):
                started.set()
            elif event.HasField("sample"):
                samples.append(event.sample)
        started.set()
        return samples

    calls = [asyncio.create_task(collect(event)) for event in started]
    await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 60)
    update = await client.push_weights(parameters_of_seed(SEED + 2), version + 1)
    groups = await asyncio.wait_for(asyncio.gather(*calls), 120)
    assert update.policy_version == version + 1
    assert update.requests_spanning_versions >= 1
    samples = [sample for group in groups for sample in group]
    assert len(samples) == 12
    spanning = 0
    for sample in samples:
        spans = [(s.start, s.end, s.policy_version) for s in sample.version_spans]
        # spans tile the completion and versions only move forward
        assert spans[0][0] == 0 and spans[-1][1] == len(sample.completion_token_ids)
        assert all(a[1] == b[0] and a[2] < b[2] for a, b in itertools.pairwise(spans))
        assert {v for _, _, v in spans} <= {version, version + 1}
        spanning += len(spans) == 2
    assert spanning >= 1


async def test_a_second_concurrent_update_is_refused(client: PolicyClient, server: ServerProcess) -> None:
    # two clients push the same version at once: one update applies, the other is refused while
    # the first is in progress, or as stale once it has applied
    version = (await client.describe()).policy_version + 1
    weights: Mapping[str, torch.Tensor] = parameters_of_seed(SEED + 3)
    async with PolicyClient(server.target) as other:
        with pytest.raises(SciprotoError) as caught:
            await push_weights_to_all([client, other], weights, version)
    assert caught.value.reason in (Reason.UPDATE_IN_PROGRESS, Reason.STALE_VERSION)
    assert (await client.describe()).policy_version == version



async def test_update_provenance_is_checked_before_the_swap(client: PolicyClient) -> None:
    before = await client.generate_group(GREEDY)
    described = await client.describe()
    version = described.policy_version + 1
    weights = parameters_of_seed(SEED + 7)
    data = b"".join(t.numpy().tobytes() for t in weights.values())
    right = hashlib.sha256(data).digest()

    def header(**provenance: object) -> policy_pb2.WeightsHeader:
        built = header_for(weights, version)
        built.provenance.CopyFrom(policy_pb2.WeightsProvenance(**provenance))
        return built

    refused = {}
    for case, bad in {"other model": header(model_id="some-other-model"),
                      "short checksum": header(sha256=b"\1" * 8),
                      "wrong checksum": header(sha256=hashlib.sha256(b"other bytes").digest())}.items():
        with pytest.raises(InvalidArgument) as caught:
            await raw_update(client, bad, [data[:1000], data[1000:]])
        refused[case] = caught.value
    unchanged = await client.describe()
    after_refusals = await client.generate_group(GREEDY)
    await raw_update(client, header(model_id=described.model, run_id="run-42", sha256=right), [data])
    applied = await client.describe()
    # The client sends the same, with the checksum computed from the tensors.
    provenance = policy_pb2.WeightsProvenance(model_id=described.model, run_id="run-43",
                                              sha256=weights_sha256(weights))
    await client.push_weights(weights, version + 1, chunk_bytes=10_000, provenance=provenance)
    pushed = await client.describe()
    assert {case: error.reason for case, error in refused.items()} == dict.fromkeys(refused, Reason.INVALID_WEIGHTS)
    assert "serves" in refused["other model"].message and "SHA-256" in refused["wrong checksum"].message
    assert unchanged.policy_version == described.policy_version and unchanged.weights_run_id == described.weights_run_id
    assert list(after_refusals.samples[0].completion_token_ids) == list(before.samples[0].completion_token_ids)
    assert (applied.policy_version, applied.weights_run_id) == (version, "run-42")
    assert weights_sha256(weights) == right and (pushed.policy_version, pushed.weights_run_id) == (version + 1, "run-43")
