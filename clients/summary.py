"""Figures of a collection: mean reward, pass@k over groups, statuses and tokens."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from math import comb

from pydantic import BaseModel, Field

from sciproto.client.rollouts import RolloutRecord, RolloutStatus


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Unbiased pass@k of one group (Chen et al. 2021): 1 - C(n - c, k) / C(n, k)."""
    if n - correct < k:
        return 1.0
    return 1.0 - comb(n - correct, k) / comb(n, k)


def ks_for(group_size: int) -> list[int]:
    """1, 2, 4, ... up to the group size, and the group size itself."""
    ks = {k for k in (2**i for i in range(group_size.bit_length())) if k <= group_size}
    return sorted(ks | {group_size})


class CollectSummary(BaseModel):
    rollouts: int = Field(description="Rollouts in the output file (SCORED and UNSCORED)")
    groups: int
    scored: int
    unscored: int
    infra_errors: int = Field(description="INFRA_ERROR rollouts of this run (the failures file)")
    mean_reward: float | None = Field(description="Over SCORED rollouts")
    pass_at_k: dict[str, float] = Field(description="Mean over groups whose samples were all SCORED; a sample"
                                                    " passes when its reward >= success_reward")
    success_reward: float
    tokens: dict[str, int]
    seconds: float = Field(description="Wall time of this run")
    rollouts_per_s: float = Field(description="Rollouts finished by this run per second")
    judged_this_run: int = Field(0, description="SCORED and UNSCORED rollouts this run wrote")


def summarize(rollouts: Iterable[RolloutRecord], failures: int, *, success_reward: float, seconds: float,
              finished_this_run: int, judged_this_run: int = 0) -> CollectSummary:
    records = list(rollouts)
    scored = [r for r in records if r.status is RolloutStatus.SCORED]
    groups: dict[str, list[RolloutRecord]] = defaultdict(list)
    for record in records:
        groups[record.group_id].append(record)
    judged = [g for g in groups.values() if all(r.status is RolloutStatus.SCORED for r in g)]
    by_k: dict[int, list[float]] = defaultdict(list)
    for group in judged:
        correct = sum(r.reward >= success_reward for r in group)
        for k in ks_for(len(group)):
            by_k[k].append(pass_at_k(len(group), correct, k))
    return CollectSummary(
        rollouts=len(records), groups=len(groups), scored=len(scored),
        unscored=sum(r.status is RolloutStatus.UNSCORED for r in records), infra_errors=failures,
        mean_reward=sum(r.reward for r in scored) / len(scored) if scored else None,
        pass_at_k={f"pass@{k}": sum(values) / len(values) for k, values in sorted(by_k.items())},
        success_reward=success_reward,
        tokens={"prompt": sum(r.tokens.prompt for r in records), "completion": sum(r.tokens.completion for r in records)},
        seconds=round(seconds, 3),
        rollouts_per_s=round(finished_this_run / seconds, 3) if seconds > 0 else 0.0,
        judged_this_run=judged_this_run,
    )
