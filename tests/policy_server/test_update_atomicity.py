"""Weight updates are all or nothing, for the caller too: an update whose caller stopped waiting
is never applied afterwards, and the engine keeps serving."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from policy_server.backends.transformers_backend import TransformersBackend
from policy_server.types import ChatMessage, GenerationRequest, SampleResult, SamplingParams
from sciproto.models import load_model


def _greedy() -> GenerationRequest:
    return GenerationRequest(messages=[ChatMessage("user", "hello")],
                             sampling=SamplingParams(temperature=0, max_tokens=8))


async def _tokens(backend: TransformersBackend) -> list[int]:
    results = [e async for e in backend.generate(_greedy()) if isinstance(e, SampleResult)]
    return results[0].completion_token_ids


async def test_an_update_that_timed_out_for_its_caller_is_never_applied():
    backend = TransformersBackend(load_model("tiny", seed=0), stall_timeout_s=0.5)
    other = {name: p.detach().clone() for name, p in load_model("tiny", seed=1).model.named_parameters()}
    try:
        before = await _tokens(backend)
        # The engine is busy (it holds its lock for a decode step that outlasts the caller's wait).
        backend._engine_lock.acquire()
        try:
            with pytest.raises(TimeoutError):
                await backend.update_weights(1, other)
        finally:
            backend._engine_lock.release()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and backend._inbox.qsize():
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # time for the engine to reach the withdrawn update
        assert backend.info().policy_version == 0
        served = dict(backend._model.named_parameters())
        assert not any(torch.equal(served[name], other[name]) for name in ("lm_head.weight",) if name in served)
        assert await _tokens(backend) == before  # the engine is alive, on the old weights
        await backend.update_weights(1, other)  # and the same version can still be sent again
        assert backend.info().policy_version == 1
    finally:
        await backend.close()
