"""Every weight update carries each tensor's digest (XXH3-128) and the set's; a real `tiny` policy server
checks what it received before it swaps, over gRPC chunks and over the gloo group alike, refuses
an altered tensor by name with the old weights serving on, and reports the digest of what it
serves in Describe."""

from __future__ import annotations

import asyncio

import pytest
import xxhash
from policy_service_helpers import SEED, policy_server_process, reference_model
from test_collective_weights import _free_port, _greedy, _rendezvous, _served_by, _server_flags
from test_service_weights import GREEDY, parameters_of_seed, raw_update

from learner.collective_push import CollectiveWeightPusher, GlooTransfer
from sciproto.client.policy import PolicyClient, distinct_tensors
from sciproto.errors import InvalidArgument, Reason, Unavailable
from sciproto.pb import policy_grpc, policy_pb2
from sciproto.weights.wire import header_for

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHUNK = 10_000


def altered_at(data: bytes, position: int) -> bytes:
    return data[:position] + bytes([data[position] ^ 0x01]) + data[position + 1:]


def tensor_at(tensors: dict, position: int) -> str:
    """The name of the tensor whose bytes hold stream offset `position`."""
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if position < size:
            return name
        position -= size
    raise AssertionError("past the end")


async def test_a_chunk_altered_in_flight_is_refused_naming_its_tensor(client: PolicyClient) -> None:
    before = await client.describe()
    greedy_before = await client.generate_group(GREEDY)
    version = before.policy_version + 1
    weights = parameters_of_seed(SEED + 11)
    digests = [xxhash.xxh3_128_digest(t.numpy().tobytes()) for t in weights.values()]
    header = header_for(weights, version)
    for spec, digest in zip(header.tensors, digests):
        spec.digest = digest
    header.provenance.set_digest = xxhash.xxh3_128_digest(b"".join(digests))
    data = b"".join(t.numpy().tobytes() for t in weights.values())
    position = 3 * CHUNK + 17  # one bit of the fourth chunk flips on the way
    chunks = [altered_at(data, position)[i:i + CHUNK] for i in range(0, len(data), CHUNK)]
    with pytest.raises(InvalidArgument) as refused:
        await raw_update(client, header, chunks)
    kept = await client.describe()
    greedy_kept = await client.generate_group(GREEDY)

    await raw_update(client, header, [data[i:i + CHUNK] for i in range(0, len(data), CHUNK)])  # unaltered
    applied = await client.describe()

    name = tensor_at(weights, position)
    assert refused.value.reason == Reason.INVALID_WEIGHTS and refused.value.metadata.get("tensor") == name
    assert f"tensor {name!r}" in refused.value.message and "old weights keep serving" in refused.value.message
    assert (kept.policy_version, kept.weights_digest) == (before.policy_version, before.weights_digest)
    assert list(greedy_kept.samples[0].completion_token_ids) == list(greedy_before.samples[0].completion_token_ids)
    assert applied.policy_version == version and applied.weights_digest == header.provenance.set_digest
    assert [(t.name, t.digest) for t in applied.serving_tensors] == list(zip(weights, digests))


async def test_a_header_whose_set_digest_is_not_its_tensors_is_refused_before_any_data(client: PolicyClient) -> None:
    before = await client.describe()
    weights = parameters_of_seed(SEED + 12)
    digests = [xxhash.xxh3_128_digest(t.numpy().tobytes()) for t in weights.values()]
    header = header_for(weights, before.policy_version + 1)
    for spec, digest in zip(header.tensors, digests):
        spec.digest = digest
    partial = policy_pb2.WeightsHeader()
    partial.CopyFrom(header)
    header.provenance.set_digest = bytes(16)
    partial.tensors[2].ClearField("digest")
    with pytest.raises(InvalidArgument) as inconsistent:
        await raw_update(client, header, [])
    with pytest.raises(InvalidArgument) as some_only:
        await raw_update(client, partial, [])
    assert "set_digest" in inconsistent.value.message
    assert some_only.value.metadata.get("tensor") == partial.tensors[2].name
    assert (await client.describe()).policy_version == before.policy_version


class AlteringTransfer(GlooTransfer):
    """Flips one bit of `victim` on the way, once: a tensor corrupted on the collective group."""

    def __init__(self, rendezvous, victim: str) -> None:
        super().__init__(rendezvous)
        self.victim = victim

    def send(self, tensors) -> None:
        victim, self.victim = self.victim, ""
        if victim:
            altered = tensors[victim].clone()
            altered.view(-1)[0] += 1.0
            tensors = dict(tensors) | {victim: altered}
        super().send(tensors)


async def _describe(target: str) -> policy_pb2.PolicyServiceDescribeResponse:
    import grpc

    async with grpc.aio.insecure_channel(target) as channel:
        return await policy_grpc.PolicyServiceStub(channel).Describe(policy_pb2.PolicyServiceDescribeRequest(),
                                                                      timeout=10)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["transformers", "vllm"])
async def test_a_tensor_altered_on_the_gloo_group_is_refused_and_the_old_weights_serve(backend: str) -> None:
    port = _free_port()
    # a loaded machine may take a while to form the group; the test waits on nothing else
    rendezvous = _rendezvous(port).model_copy(update={"world_size": 2, "timeout_s": 60})
    generator = policy_server_process(*_server_flags(rendezvous, backend))
    server = next(generator)
    weights = distinct_tensors(dict(reference_model(seed=1).model.state_dict()))
    victim = list(weights)[3]
    pusher = CollectiveWeightPusher([server.target], AlteringTransfer(rendezvous, victim), timeout_s=120)
    try:
        with pytest.raises(Unavailable) as failed:
            await pusher.push(weights, 1)
        kept = await _describe(server.target)
        tokens, logprobs = await _greedy(server.target)
        served_old = _served_by(SEED, tokens, logprobs)
        result = await pusher.push(weights, 2)  # the same push unaltered: taken
        applied = await _describe(server.target)
        tokens, logprobs = await _greedy(server.target)
        served_new = _served_by(1, tokens, logprobs)
    finally:
        await asyncio.wait_for(pusher.aclose(), 60)
        generator.close()
    assert f"tensor {victim!r}" in str(failed.value)
    assert kept.policy_version == 0 and not kept.weights_digest and served_old
    assert applied.policy_version == 2 and applied.weights_digest == result.set_digest and served_new
    assert [t.name for t in applied.serving_tensors] == list(weights)


class LyingProxy:
    """An in-process gRPC proxy in front of a real policy server whose Describe, after the first
    update through it and until the next, reports another digest for one tensor: a server that
    does not serve the weights it was sent."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.headers: list[policy_pb2.WeightsHeader] = []
        self.lied_about = ""

    async def start(self) -> str:
        import grpc

        from sciproto.pb import POLICY_SERVICE

        self._channel = grpc.aio.insecure_channel(self.upstream)
        describe = self._channel.unary_unary(f"/{POLICY_SERVICE}/Describe")
        update = self._channel.stream_unary(f"/{POLICY_SERVICE}/UpdateWeights")

        async def on_describe(request: bytes, context) -> bytes:
            reply = policy_pb2.PolicyServiceDescribeResponse.FromString(await describe(request, timeout=10))
            if len(self.headers) == 1 and reply.weights_digest:
                reply.weights_digest = bytes(16)
                reply.serving_tensors[1].digest = bytes(16)
                self.lied_about = reply.serving_tensors[1].name
            return reply.SerializeToString()

        async def on_update(requests, context) -> bytes:
            async def forward():
                first = True
                async for message in requests:
                    if first:
                        self.headers.append(policy_pb2.UpdateWeightsRequest.FromString(message).header)
                        first = False
                    yield message
            return await update(forward(), timeout=60)

        handlers = {
            "Describe": grpc.unary_unary_rpc_method_handler(on_describe),
            "UpdateWeights": grpc.stream_unary_rpc_method_handler(on_update),
        }
        self._server = grpc.aio.server()
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(POLICY_SERVICE, handlers),))
        port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        return f"127.0.0.1:{port}"

    async def stop(self) -> None:
        await self._server.stop(0)
        await self._channel.close()


@pytest.mark.slow
async def test_a_server_reporting_another_digest_is_pushed_again(client: PolicyClient, server, tmp_path) -> None:
    import yaml

    from sciproto.processes import start_server

    before = await client.describe()
    # the server serves other weights than the learner's: the learner pushes its own at start
    await client.push_weights(parameters_of_seed(SEED + 13), before.policy_version + 1)
    proxy = LyingProxy(server.target)
    target = await proxy.start()
    config = tmp_path / "learner.yaml"
    config.write_text(yaml.safe_dump({"learner": {
        "model": "tiny", "policy_targets": [target], "run_dir": str(tmp_path / "run"), "reconcile_interval_s": 0.5}}))
    # in a thread: the proxy serves the learner's start-up push from this event loop
    learner = await asyncio.to_thread(start_server, ["serve", "learner", "--config", str(config), "--port", "0"])
    try:
        for _ in range(240):  # the learner's start push, then at most a few reconcile rounds
            served = await client.describe()
            if len(proxy.headers) >= 2 and served.policy_version == proxy.headers[-1].policy_version:
                break
            await asyncio.sleep(0.25)
        await asyncio.sleep(1.5)  # a few more reconcile rounds: none pushes again
        log = "\n".join(learner.output)
    finally:
        await asyncio.to_thread(learner.stop)
        await proxy.stop()
    first, second = proxy.headers[0], proxy.headers[-1]
    assert len(proxy.headers) == 2, log
    assert first.policy_version == before.policy_version + 2 and second.policy_version == first.policy_version + 1
    assert first.provenance.set_digest and second.provenance.set_digest == first.provenance.set_digest
    assert (served.policy_version, served.weights_digest) == (second.policy_version, second.provenance.set_digest)
    assert f"tensor {proxy.lied_about!r}" in log and "does not serve the weights the learner trained" in log
