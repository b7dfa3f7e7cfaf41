import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio
from policy_service_helpers import policy_server_process

from policy_server.backends.transformers_backend import TransformersBackend
from policy_server.types import GenerationRequest, SampleResult, TokenDelta
from sciproto.client.policy import PolicyClient
from sciproto.models import LoadedModel, load_model
from sciproto.processes import ServerProcess


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


# One policy server process per test module that asks for it (module scope).
@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    yield from policy_server_process()


@pytest_asyncio.fixture(loop_scope="module")
async def client(server: ServerProcess) -> AsyncIterator[PolicyClient]:
    async with PolicyClient(server.target) as client:
        yield client
