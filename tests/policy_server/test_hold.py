"""PolicyService.Hold (protocol 1.5) against a real `tiny` policy server process (transformers
backend): no token is sampled while a hold is open, nothing running is lost, weight updates still
apply, and every way a hold can end (half-close, cancel, max_seconds) lets generation go on."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from policy_service_helpers import SEED, reference_model

from sciproto.client.policy import PolicyClient, distinct_tensors, generate_request
from sciproto.errors import InvalidArgument
from sciproto.pb import policy_grpc, policy_pb2

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = [10, 20, 30, 40]


class Reader:
    """Reads one Generate call in the background, counting its tokens as they arrive."""

    def __init__(self, client: PolicyClient, n: int = 3, max_tokens: int = 400) -> None:
        request = generate_request(prompt_token_ids=PROMPT, temperature=1.0, max_tokens=max_tokens, n=n, seed=1)
        self.tokens = 0
        self.samples: list[policy_pb2.GenerateSample] = []
        self.task = asyncio.create_task(self._read(client, request))

    async def _read(self, client: PolicyClient, request: policy_pb2.GenerateRequest) -> None:
        async for event in client.generate(request, timeout_s=120):
            if event.WhichOneof("event") == "delta":
                self.tokens += len(event.delta.token_ids)
            elif event.WhichOneof("event") == "sample":
                self.samples.append(event.sample)

    async def started(self) -> None:
        for _ in range(400):
            if self.tokens:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("no token arrived within 4 s")


async def test_no_token_is_sampled_while_held_and_nothing_is_lost(client: PolicyClient) -> None:
    described = await client.describe(timeout_s=10)
    assert "hold" in described.server.capabilities
    reader = Reader(client)
    await reader.started()
    before = time.time()
    async with client.hold(reason="test", timeout_s=30) as window:
        assert before - 1 <= window.held_at <= time.time() + 1
        assert window.requests_held == 1
        await asyncio.sleep(0.3)  # deltas already sampled before the hold drain
        frozen = reader.tokens
        await asyncio.sleep(1.5)
        assert reader.tokens == frozen, "tokens were sampled while the hold was open"
        assert not reader.task.done()
    assert window.release_reason == "released"
    assert window.held_at <= window.released_at <= time.time() + 1
    await asyncio.wait_for(reader.task, 60)
    assert len(reader.samples) == 3
    assert sum(len(s.completion_token_ids) for s in reader.samples) == reader.tokens


async def test_weights_update_while_held_and_samples_span_both_versions(client: PolicyClient) -> None:
    version = (await client.describe(timeout_s=10)).policy_version
    reader = Reader(client, n=2, max_tokens=300)
    await reader.started()
    weights = distinct_tensors(reference_model(SEED + 1).model.state_dict())
    async with client.hold(reason="learner step", timeout_s=30):
        await asyncio.sleep(0.2)
        frozen = reader.tokens
        response = await client.push_weights(weights, version=version + 1, timeout_s=60)
        assert response.policy_version == version + 1
        assert response.requests_spanning_versions == 1
        assert reader.tokens == frozen
    await asyncio.wait_for(reader.task, 60)
    for sample in reader.samples:
        if sample.finish_reason != policy_pb2.FINISH_REASON_STOP or len(sample.version_spans) > 1:
            assert [span.policy_version for span in sample.version_spans] == [version, version + 1]


async def test_a_cancelled_hold_and_one_past_max_seconds_are_released(client: PolicyClient) -> None:
    stub = policy_grpc.PolicyServiceStub(client.channel)
    call = stub.Hold()
    await call.write(policy_pb2.HoldRequest(reason="will be cancelled"))
    assert (await asyncio.wait_for(call.read(), 30)).state == policy_pb2.HOLD_STATE_HELD
    call.cancel()
    reader = Reader(client, n=1, max_tokens=40)
    await asyncio.wait_for(reader.task, 30)  # generation runs again: the cancel released the hold
    assert len(reader.samples) == 1

    started = time.monotonic()
    async with client.hold(max_seconds=0.5, timeout_s=30) as window:
        reader = Reader(client, n=1, max_tokens=40)
        await asyncio.wait_for(reader.task, 30)  # released by the server after 0.5 s
        assert time.monotonic() - started >= 0.4
    assert window.release_reason == "max_seconds"


async def test_nested_holds_release_with_the_last_and_bad_input_is_refused(client: PolicyClient) -> None:
    async with client.hold(timeout_s=30):
        async with client.hold(timeout_s=30):
            reader = Reader(client, n=1, max_tokens=40)
            await asyncio.sleep(0.5)
        await asyncio.sleep(0.5)
        assert reader.tokens == 0, "one hold still open, yet tokens were sampled"
    await asyncio.wait_for(reader.task, 30)
    assert reader.samples

    with pytest.raises(InvalidArgument, match="max_seconds"):
        async with client.hold(max_seconds=-1, timeout_s=30):
            pass
    # a call closed before asking holds nothing and ends cleanly
    call = policy_grpc.PolicyServiceStub(client.channel).Hold()
    await call.done_writing()
    assert await asyncio.wait_for(call.read(), 30) is grpc.aio.EOF
    assert (await client.describe(timeout_s=10)).active_requests == 0
