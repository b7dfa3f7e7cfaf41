"""How fast the run's policy servers generate on their own, timed once before the first rollout, so
that the summary can set the run's own generation rate beside it: what generating inside the run
costs (the learner's step on the same cores, waits on the learner, env and tool time).

The calibration sends `display.calibration_groups` Generate calls of `rollout.samples` samples to
every policy server at once (base weights, the rollout's temperature, at most
`display.calibration_max_tokens` tokens each) and counts the completion tokens that came back per
second of wall time. It is one short batch, so it reads low against a long run's full batches on a
GPU; on a small CPU, where a batch of 16 already keeps the cores busy, it is the rate alone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass

from sciproto.client.policy import PolicyClient, generate_request
from sciproto.client.replicas import ReplicaPool
from sciproto.errors import first_line
from sciproto.pb import common_pb2

log = logging.getLogger(__name__)

PROMPT = ("Explain, step by step, how to find the sum of the first hundred whole numbers, "
          "and check the answer another way.")


@dataclass(frozen=True)
class Calibration:
    """Completion tokens generated alone, and in how many wall seconds."""

    tokens: int
    seconds: float
    servers: int
    groups: int  # per server
    samples: int  # per group

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> dict[str, float | int]:
        return asdict(self) | {"tokens_per_s": round(self.tokens_per_s, 1)}


async def calibrate(policy: ReplicaPool[PolicyClient], *, groups: int, samples: int, max_tokens: int,
                    temperature: float, timeout_s: float) -> Calibration | None:
    """Time `groups` Generate calls of `samples` samples on every healthy policy server at once.
    None when `groups` is 0, no server is up, or a call fails (logged: the run goes on without it)."""
    replicas = policy.healthy()
    if groups <= 0 or not replicas:
        return None
    message = common_pb2.ChatMessage(role=common_pb2.ROLE_USER, content=PROMPT)
    request = generate_request(messages=[message], temperature=temperature, max_tokens=max_tokens, n=samples)
    started = time.perf_counter()
    try:
        results = await asyncio.gather(*(replica.client.generate_group(request, timeout_s=timeout_s)
                                         for replica in replicas for _ in range(groups)))
    except Exception as error:  # noqa: BLE001 - a figure for the summary; the run itself goes on
        log.warning("generation calibration skipped: %s", first_line(error))
        return None
    seconds = time.perf_counter() - started
    tokens = sum(len(sample.completion_token_ids) for group in results for sample in group.samples)
    return Calibration(tokens=tokens, seconds=seconds, servers=len(replicas), groups=groups, samples=samples)


__all__ = ["Calibration", "calibrate"]
