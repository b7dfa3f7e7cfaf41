import asyncio

import pytest

from policy_server.backends.transformers_backend import TransformersBackend
from policy_server.models import LoadedModel, load_model
from policy_server.types import GenerationRequest, SampleResult, TokenDelta


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    return load_model("tiny", seed=0)


@pytest.fixture
def backend(tiny: LoadedModel):
    # A fresh copy of the weights per test, since some tests update them in place.
    model = load_model("tiny", seed=0)
    served = TransformersBackend(model, stream_interval=4)
    yield served
    asyncio.run(served.close())


async def _collect(
    backend: TransformersBackend, request: GenerationRequest
) -> tuple[list[SampleResult], list[TokenDelta]]:
    """All events of one generate call: results by sample index, and the deltas."""
    results, deltas = [], []
    async for event in backend.generate(request):
        (results if isinstance(event, SampleResult) else deltas).append(event)
    return sorted(results, key=lambda r: r.sample_index), deltas


@pytest.fixture
def collect():
    return _collect
