"""Flow control of `sciproto train`: every group the rollout client generated, until the learner
settles it, and how many groups may be started before the learner has settled the earlier ones.

A group is *settled* once the learner says what became of it, and then exactly once:

| fate              | how the learner says it                                        |
|-------------------|----------------------------------------------------------------|
| `consumed`        | a step result lists it in `consumed_group_ids`                 |
| `dropped_stale`   | a step result lists it in `dropped_stale_group_ids`            |
| `refused_stale`   | its receipt: reason "stale" (too old on arrival)               |
| `skipped_equal`   | its receipt: reason "no_signal" (all rewards equal)            |
| `refused_invalid` | its receipt: reason "invalid"                                  |
| `abandoned`       | a StepFailure lists it in `abandoned_group_ids`                |

Until then the ledger keeps the group's message: a "busy" receipt sends it again, and so does a
new TrainStep stream after the old one broke (a restarted learner lost its buffer; the learner's
duplicate check makes resending safe: a copy still buffered is accepted again, a copy of a
settled group is refused as "duplicate" with its fate in the receipt's detail).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from sciproto.pb import common_pb2, learner_pb2

FATES = (
    "consumed",
    "dropped_stale",
    "refused_stale",
    "skipped_equal",
    "refused_invalid",
    "abandoned",
)
_RECEIPT_FATES = {"stale": "refused_stale", "no_signal": "skipped_equal", "invalid": "refused_invalid"}
# What a "duplicate" receipt's detail says became of the first copy.
_DUPLICATE_FATES = {
    "consumed": "consumed",
    "stale": "dropped_stale",
    "no_signal": "skipped_equal",
    "abandoned": "abandoned",
}


def shared_reward(group: learner_pb2.RolloutGroup) -> float | None:
    """The reward the scored samples of a group without signal share (as the learner judges it:
    learner.buffer); None when fewer than two were scored."""
    scored = [r.reward.value for r in group.rollouts if r.reward.status == common_pb2.REWARD_STATUS_SCORED]
    return round(scored[0], 3) if len(scored) >= 2 else None


class GroupLedger:
    """The groups generated and not yet settled, and the fate of every settled one."""

    def __init__(self) -> None:
        self.unsettled: dict[str, learner_pb2.TrainStepRequest] = {}  # in generation order
        self.sent: set[str] = set()  # unsettled groups written to some stream
        self.accepted: set[str] = set()  # unsettled groups the learner holds (as far as we know)
        # Every fate recorded per group: one entry each, or the accounting is wrong.
        self.fates: dict[str, list[str]] = {}
        self.counts: Counter[str] = Counter()
        # Fates since the last step result, and the groups the learner accepted since then.
        self.since_step: Counter[str] = Counter()
        # The common reward of each all-equal group since the last step: all right, or all wrong?
        self.equal_rewards: Counter[float | None] = Counter()
        self.resent = 0

    def add(self, request: learner_pb2.TrainStepRequest) -> None:
        self.unsettled[request.group.group_id] = request
        self.fates.setdefault(request.group.group_id, [])

    def settle(self, group_id: str, fate: str) -> int:
        """Record `fate` for `group_id`; 1 if that settled an unsettled group, else 0."""
        if group_id not in self.fates:
            return 0  # not ours (an older run's, or another client's)
        self.fates[group_id].append(fate)
        request = self.unsettled.pop(group_id, None)
        if request is None:
            return 0  # settled twice: kept in `fates` for whoever checks
        if fate == "skipped_equal":
            self.equal_rewards[shared_reward(request.group)] += 1
        self.sent.discard(group_id)
        self.accepted.discard(group_id)
        self.counts[fate] += 1
        self.since_step[fate] += 1
        return 1

    def on_receipt(self, receipt: learner_pb2.GroupReceipt) -> tuple[int, bool]:
        """(groups settled, whether to send the group again)."""
        group_id = receipt.group_id
        if receipt.accepted:
            if group_id in self.unsettled and group_id not in self.accepted:
                self.accepted.add(group_id)
                self.since_step["accepted"] += 1  # held for a step: not a fate, but it has signal
            return 0, False
        if receipt.reason == "busy":
            return 0, group_id in self.unsettled
        if receipt.reason == "duplicate":
            if group_id not in self.unsettled:
                return 0, False  # a resent copy of a group settled meanwhile
            return self.settle(group_id, _DUPLICATE_FATES.get(receipt.detail, "consumed")), False
        return self.settle(group_id, _RECEIPT_FATES.get(receipt.reason, "refused_invalid")), False

    def on_step(self, result: learner_pb2.OptimizerStepResult) -> int:
        self.since_step.clear()
        self.equal_rewards.clear()
        settled = sum(self.settle(g, "consumed") for g in result.consumed_group_ids)
        return settled + sum(self.settle(g, "dropped_stale") for g in result.dropped_stale_group_ids)

    def on_step_failure(self, failure: learner_pb2.StepFailure) -> int:
        return sum(self.settle(g, "abandoned") for g in failure.abandoned_group_ids)

    def to_resend(self) -> list[learner_pb2.TrainStepRequest]:
        """Every unsettled group, for a new stream; counts those sent before as resent."""
        self.resent += len(self.sent)
        self.accepted.clear()
        self.sent = set(self.unsettled)
        return list(self.unsettled.values())

    @property
    def settled(self) -> int:
        return sum(self.counts.values())


class Flow:
    """Counts that gate the rollout client: groups started vs settled by the learner, and time
    spent with nothing generating."""

    def __init__(self, max_ahead: int) -> None:
        self.max_ahead = max_ahead
        self.started = 0
        self.finished = 0
        self.consumed = 0  # settled, whatever the fate
        self.changed = asyncio.Condition()
        self.idle_s = 0.0
        self._idle_since: float | None = time.monotonic()

    def _mark(self) -> None:
        now = time.monotonic()
        in_flight = self.started - self.finished
        if in_flight == 0 and self._idle_since is None:
            self._idle_since = now
        elif in_flight > 0 and self._idle_since is not None:
            self.idle_s += now - self._idle_since
            self._idle_since = None

    @property
    def in_flight(self) -> int:
        """Groups started and not finished generating."""
        return self.started - self.finished

    async def admit(self) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: self.started - self.consumed < self.max_ahead)
            self.started += 1
            self._mark()

    def group_finished(self) -> None:
        self.finished += 1
        self._mark()

    async def task_finished(self, groups: int) -> None:
        """A task admitted as one group finished as `groups` groups (rollout.grouping step: one
        per step group, maybe none): each is settled by the learner like any group, and with
        none the task's place is free again."""
        async with self.changed:
            self.started += groups - 1
            self.finished += groups
            self._mark()
            self.changed.notify_all()

    async def consume(self, count: int) -> None:
        if not count:
            return
        async with self.changed:
            self.consumed += count
            self.changed.notify_all()

    def total_idle_s(self) -> float:
        return self.idle_s + (
            time.monotonic() - self._idle_since if self._idle_since is not None else 0.0
        )


__all__ = ["FATES", "Flow", "GroupLedger", "shared_reward"]
