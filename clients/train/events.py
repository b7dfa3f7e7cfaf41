"""The one place the learner's events land in `sciproto train`.

A receipt settles a group (accepted, refused, no room: sent again), a step result consumes groups
and may spend the budget, a step failure gives groups back. Each event updates the ledger and the
flow (which groups are settled, how many more may start), the status the display shows and the
outcome the summary reports; `settle` writes the ledger's final counts into the outcome.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from clients.train.config import Budget
from clients.train.display import RunStatus
from clients.train.flow import Flow, GroupLedger
from clients.train.records import StepRecord, TrainOutcome, budget_spent
from clients.train.stream import LearnerStream
from sciproto.pb import learner_pb2

log = logging.getLogger(__name__)


@dataclass
class LearnerEvents:
    """Turns each TrainStep event into the ledger, the display's status and the run's outcome."""

    budget: Budget
    flow: Flow
    ledger: GroupLedger
    status: RunStatus
    outcome: TrainOutcome
    learner: LearnerStream
    stop: asyncio.Event
    started: float
    on_step: Callable[[StepRecord, TrainOutcome], None]

    def stop_with(self, reason: str) -> None:
        """End the run, saying why (the first reason given stands)."""
        self.outcome.stopped_by = self.outcome.stopped_by or reason
        self.stop.set()

    async def handle(self, event: learner_pb2.TrainStepResponse) -> None:
        kind = event.WhichOneof("event")
        if kind == "receipt":
            await self._receipt(event.receipt)
        elif kind == "step":
            await self._step(event.step)
        elif kind == "step_failure":
            await self._step_failure(event.step_failure)
        else:
            log.warning("learner reported: %s", event.error.message)
        self.status.groups_in_learner = len(self.ledger.accepted)
        self.status.since_step = self.ledger.since_step
        self.status.equal_rewards = self.ledger.equal_rewards

    async def _receipt(self, receipt: learner_pb2.GroupReceipt) -> None:
        settled, again = self.ledger.on_receipt(receipt)
        if not receipt.accepted:
            reason = receipt.reason
            self.outcome.groups_refused[reason] = self.outcome.groups_refused.get(reason, 0) + 1
            if reason == "invalid":
                log.warning("learner refused group %s: %s", receipt.group_id, receipt.detail)
        if again:
            self.learner.send_again_later(receipt.group_id)
        await self.flow.consume(settled)

    async def _step(self, result: learner_pb2.OptimizerStepResult) -> None:
        await self.flow.consume(self.ledger.on_step(result))
        now = time.monotonic()
        record = self._record(result, now)
        status = self.status
        status.step, status.policy_version = record.step, record.policy_version
        status.reward_mean, status.policy_lag_mean = record.reward_mean, record.policy_lag_mean
        status.sft_loss = record.sft_loss if record.objective == "sft" else status.sft_loss
        status.last_step_at = now
        if status.first_step_s is None:
            status.first_step_s = now - self.started
        self.outcome.steps.append(record)
        self.on_step(record, self.outcome)
        if reason := budget_spent(self.budget, self.outcome.steps):
            self.stop_with(reason)

    def _record(self, result: learner_pb2.OptimizerStepResult, now: float) -> StepRecord:
        sft = "sft_loss" in result.metrics
        return StepRecord(
            step=result.step,
            policy_version=result.policy_version,
            reward_mean=math.nan if sft else result.metrics.get("reward_mean", math.nan),
            objective="sft" if sft else "grpo",
            sft_loss=result.metrics.get("sft_loss"),
            sft_token_accuracy=result.metrics.get("sft_token_accuracy"),
            policy_lag_mean=result.metrics.get("policy_lag_mean", 0.0),
            groups=result.groups,
            seconds=now - self.started,
            forks_opened=self.status.forks_opened,
            forks_closed=self.status.forks_closed if self.status.forks_opened is not None else None,
        )

    async def _step_failure(self, failure: learner_pb2.StepFailure) -> None:
        self.outcome.step_failures += 1
        self.status.step_failures += 1
        log.warning(
            "learner step failed (%s); %d of our groups went back, %d given up",
            failure.error.message,
            len(failure.returned_group_ids),
            len(failure.abandoned_group_ids),
        )
        await self.flow.consume(self.ledger.on_step_failure(failure))

    def settle(self) -> None:
        """The run has stopped: what became of its groups, into the outcome."""
        outcome, ledger = self.outcome, self.ledger
        outcome.seconds = time.monotonic() - self.started
        outcome.generation_idle_s = self.flow.total_idle_s()
        outcome.groups_settled = dict(ledger.counts)
        outcome.groups_pending = len(ledger.unsettled)
        outcome.groups_resent = ledger.resent
        outcome.learner_reconnects = self.learner.reconnects
        outcome.group_fates = {g: fates or ["pending"] for g, fates in ledger.fates.items()}
        outcome.first_step_s = self.status.first_step_s


__all__ = ["LearnerEvents"]
