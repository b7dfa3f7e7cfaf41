"""Shared by the PolicyService tests: a real policy server process and the reference forward
pass the served logprobs are checked against."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence

import torch

from sciproto.client.policy import PolicyClient
from sciproto.models import LoadedModel, load_model
from sciproto.processes import ServerProcess, start_server

SEED = 3  # the served tiny model's seed; the tests rebuild the same weights in-process


def policy_server_process(*extra: str) -> Iterator[ServerProcess]:
    """A `tiny` policy server on a free port, stopped when the generator resumes."""
    server = start_server(["serve", "policy", "--port", "0", "--model", "tiny", "--set", f"seed={SEED}",
                           "--set", "transformers.batch_window_s=0.002", *extra], timeout_s=300)
    try:
        yield server
    finally:
        server.stop()


def reference_model(seed: int = SEED) -> LoadedModel:
    return load_model("tiny", dtype=torch.float32, seed=seed)


def reference_logprobs(model: torch.nn.Module, prompt: Sequence[int], completion: Sequence[int]) -> torch.Tensor:
    """log softmax(logits) of each completion token given everything before it (temperature 1,
    top_p 1: the distribution the server samples from)."""
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logprobs.gather(1, torch.tensor(completion).unsqueeze(1)).squeeze(1)


async def wait_until_idle(client: PolicyClient, timeout_s: float = 20.0) -> int:
    """Poll Describe until no Generate call is running; return the last count seen."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        active = (await client.describe(timeout_s=5)).active_requests
        if active == 0 or loop.time() > deadline:
            return active
        await asyncio.sleep(0.05)
