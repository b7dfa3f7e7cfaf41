"""The vllm backend's own bookkeeping, without vLLM (a CUDA-only package): an engine stand-in that
streams plain records shaped like vLLM's DELTA outputs (RequestOutput.outputs of CompletionOutput
with index, token_ids, text, logprobs, finish_reason) and takes the update-session calls. What it
checks: the version spans the backend builds from the pause, and that an update failing after
loading began leaves the server unavailable (health NOT_SERVING, Generate UNAVAILABLE) until a
complete update."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from policy_server.backends.registry import backend_plugin
from policy_server.backends.vllm_backend import Platform, VllmBackend, VllmOptions, VllmTypes
from policy_server.config import PolicyServerConfig
from policy_server.service import PolicyServicer, register
from policy_server.types import (
    GenerationRequest,
    SampleResult,
    SamplingParams,
    TensorSpec,
    VersionSpan,
)
from sciproto.models import load_model
from sciproto.pb import POLICY_SERVICE, policy_grpc, policy_pb2
from sciproto.server import ServerConfig, Service, start_server
from sciproto.weights.rendezvous import CollectiveRendezvous

MANIFEST = [TensorSpec("w", (2,), "float32")]


def _completion(index: int, tokens: list[int], finish: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(index=index, token_ids=tokens, text="x" * len(tokens), finish_reason=finish,
                           logprobs=[{t: SimpleNamespace(logprob=-0.5)} for t in tokens])


class Engine:
    """Stands in for vllm.v1.engine.async_llm.AsyncLLM: outputs come from `feed`, and `late`
    records are delivered while generation is paused (sampled before the pause, read after)."""

    def __init__(self) -> None:
        self.streams: dict[str, asyncio.Queue] = {}
        self.late: list[tuple[str, SimpleNamespace]] = []
        self.calls: list[str] = []
        self.fail_load = False
        self.aborted: list[str] = []

    async def generate(self, prompt, params, request_id):
        queue = self.streams.setdefault(request_id, asyncio.Queue())
        while (record := await queue.get()) is not None:
            yield record

    def feed(self, *completions: SimpleNamespace) -> None:
        (queue,) = self.streams.values()
        queue.put_nowait(SimpleNamespace(outputs=list(completions)))

    async def abort(self, request_ids) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.aborted += ids
        for request_id in ids:
            self.streams[request_id].put_nowait(SimpleNamespace(outputs=[_completion(0, [], "abort")]))

    async def pause_generation(self, *, mode: str, clear_cache: bool) -> None:
        self.calls.append(f"pause:{mode}")
        for request_id, record in self.late:
            self.streams[request_id].put_nowait(SimpleNamespace(outputs=[record]))
        self.late = []

    async def resume_generation(self) -> None:
        self.calls.append("resume")

    async def start_weight_update(self) -> None:
        self.calls.append("start")

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(method)
        if self.fail_load:
            raise RuntimeError("worker 0 failed in load_weights")

    async def finish_weight_update(self, weight_version=None) -> None:
        self.calls.append(f"finish:{weight_version}")

    async def shutdown_weight_transfer_engine(self) -> None:
        self.calls.append("shutdown_weight_transfer_engine")

    def shutdown(self) -> None:
        self.calls.append("shutdown")


@pytest.fixture
def engine() -> Engine:
    return Engine()


@pytest.fixture
def backend(engine: Engine) -> VllmBackend:
    types = VllmTypes(sampling_params=lambda **kwargs: SimpleNamespace(**kwargs), delta_kind="DELTA")
    tokenizer = load_model("tiny", seed=0).tokenizer
    return VllmBackend(engine, tokenizer, "tiny", "float32", VllmOptions(stall_timeout_s=5), MANIFEST,
                       frozenset(), 512, platform=Platform.named("cuda"), types=types)


def _request(n: int = 1) -> GenerationRequest:
    return GenerationRequest(prompt_token_ids=[5, 6, 7], sampling=SamplingParams(n=n, max_tokens=16))


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_version_spans_come_from_the_pause_not_from_the_reader(engine, backend):
    events = backend.generate(_request(n=2))
    first = asyncio.ensure_future(anext(events))  # the call starts; nobody reads it during the update
    await _settle()
    engine.feed(_completion(0, [1, 2, 3]), _completion(1, [4, 5]))
    await _settle()
    # sampled by version 0 just before the pause, but delivered only after it began
    (request_id,) = engine.streams
    engine.late = [(request_id, _completion(0, [9]))]
    await backend.update_weights(1, {"w": torch.zeros(2)})
    assert engine.calls == ["pause:keep", "start", "load_checkpoint_tensors", "finish:1", "resume"]
    engine.feed(_completion(0, [6, 7], "stop"), _completion(1, [8, 9], "length"))
    results = [await first] + [event async for event in events]
    samples = {r.sample_index: r for r in results if isinstance(r, SampleResult)}
    assert samples[0].completion_token_ids == [1, 2, 3, 9, 6, 7]
    assert samples[0].version_spans == [VersionSpan(0, 4, 0), VersionSpan(4, 6, 1)]
    assert samples[1].version_spans == [VersionSpan(0, 2, 0), VersionSpan(2, 4, 1)]
    # a request that starts after the update is wholly version 1
    engine.streams.clear()
    later = backend.generate(_request())
    pending = asyncio.ensure_future(anext(later))
    await _settle()
    engine.feed(_completion(0, [3, 4], "stop"))
    results = [await pending] + [event async for event in later]
    assert results[-1].version_spans == [VersionSpan(0, 2, 1)]


async def test_an_update_that_fails_after_loading_began_never_resumes(engine, backend):
    events = backend.generate(_request())
    first = asyncio.ensure_future(anext(events))
    await _settle()
    engine.feed(_completion(0, [1, 2]))
    engine.fail_load = True
    with pytest.raises(RuntimeError, match="load_weights"):
        await backend.update_weights(1, {"w": torch.zeros(2)})
    assert "resume" not in engine.calls  # the half-loaded weights never sample
    assert "half-loaded" in backend.info().unavailable
    results = [await first] + [event async for event in events]
    assert results[-1].finish_reason.value == "abort"  # the running request ended
    with pytest.raises(RuntimeError, match="half-loaded"):
        await anext(backend.generate(_request()))
    engine.fail_load = False
    await backend.update_weights(2, {"w": torch.zeros(2)})  # a complete update: serving again
    assert backend.info().unavailable == "" and backend.info().policy_version == 2
    assert engine.calls[-1] == "resume" and engine.calls.count("pause:keep") == 1


async def test_the_server_is_not_serving_while_the_weights_are_unavailable(engine, backend):
    config = PolicyServerConfig()
    servicer = PolicyServicer(backend, backend.prompt_token_ids, config, capabilities=backend_plugin("vllm").capabilities)
    running = await start_server(ServerConfig(port=0), [Service(POLICY_SERVICE, servicer, register)])
    servicer.health = running.health
    update = [policy_pb2.UpdateWeightsRequest(header=policy_pb2.WeightsHeader(
        policy_version=1, total_bytes=8, tensors=[policy_pb2.TensorSpec(
            name="w", shape=[2], dtype=policy_pb2.TENSOR_DTYPE_FLOAT32)])),
        policy_pb2.UpdateWeightsRequest(data=bytes(8))]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            policy = policy_grpc.PolicyServiceStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            engine.fail_load = True
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await policy.UpdateWeights(iter(update), timeout=10)
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "NOT_SERVING until a complete update" in failed.value.details()
            status = await health.Check(health_pb2.HealthCheckRequest(service=POLICY_SERVICE), timeout=5)
            assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                call = policy.Generate(policy_pb2.GenerateRequest(
                    tokens=policy_pb2.TokenPrompt(token_ids=[1, 2]), sampling=policy_pb2.SamplingParams(max_tokens=4), n=1), timeout=10)
                await call.read()
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "half-loaded" in refused.value.details()
            engine.fail_load = False
            update[0].header.policy_version = 2
            done = await policy.UpdateWeights(iter(update), timeout=10)
            assert done.policy_version == 2
            status = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert status.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await running.stop()


async def test_a_collective_header_reaches_receive_weights_collective(engine):
    """Through the gRPC service: the header-only stream joins vLLM's group once, then each update
    asks every worker for the header's tensors, in header order, with a timeout on each call. The
    header names its transport by the deprecated WEIGHT_TRANSPORT_NCCL, the same value as
    WEIGHT_TRANSPORT_COLLECTIVE: a sender of protocol 1.2 is still understood."""
    rpcs: list[tuple[str, float | None, dict | None]] = []

    async def collective_rpc(method, timeout=None, args=(), kwargs=None):
        rpcs.append((method, timeout, kwargs))
        return [("", "")]  # one worker, whose transfer did not fail

    engine.collective_rpc = collective_rpc
    manifest = [TensorSpec("b", (3,), "bfloat16"), TensorSpec("a", (2, 2), "float32")]
    options = VllmOptions(stall_timeout_s=30)
    collective = CollectiveRendezvous(master_address="127.0.0.1", master_port=29650, world_size=2, timeout_s=20)
    types = VllmTypes(sampling_params=lambda **kwargs: SimpleNamespace(**kwargs), delta_kind="DELTA")
    backend = VllmBackend(engine, load_model("tiny", seed=0).tokenizer, "tiny", "float32", options, manifest,
                          frozenset(), 512, platform=Platform.named("cuda"), collective=collective, types=types)
    servicer = PolicyServicer(backend, backend.prompt_token_ids, PolicyServerConfig(),
                              capabilities=backend_plugin("vllm").capabilities)
    running = await start_server(ServerConfig(port=0), [Service(POLICY_SERVICE, servicer, register)])
    header = policy_pb2.WeightsHeader(total_bytes=22, transport=policy_pb2.WEIGHT_TRANSPORT_NCCL, tensors=[
        policy_pb2.TensorSpec(name="a", shape=[2, 2], dtype=policy_pb2.TENSOR_DTYPE_FLOAT32),
        policy_pb2.TensorSpec(name="b", shape=[3], dtype=policy_pb2.TENSOR_DTYPE_BFLOAT16)])
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            policy = policy_grpc.PolicyServiceStub(channel)
            for version in (1, 2):
                header.policy_version = version
                reply = await policy.UpdateWeights(iter([policy_pb2.UpdateWeightsRequest(header=header)]), timeout=10)
                assert reply.policy_version == version
    finally:
        await running.stop()
    assert [method for method, _, _ in rpcs] == ["init_weight_transfer_engine", "update_weights", "take_transfer_failure",
                                                  "update_weights", "take_transfer_failure"]
    assert rpcs[0][2] == {"init_info": {"master_address": "127.0.0.1", "master_port": 29650, "rank_offset": 1,
                                        "world_size": 2, "packed": True}}
    assert rpcs[1][2] == {"update_info": {"names": ["a", "b"], "dtype_names": ["float32", "bfloat16"],
                                          "shapes": [[2, 2], [3]]}}
    assert all(timeout == 20 for _, timeout, _ in rpcs)
    assert engine.calls[-2:] == ["shutdown_weight_transfer_engine", "shutdown"]
