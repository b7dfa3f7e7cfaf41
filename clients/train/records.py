"""What a run records: the learner's messages for finished groups (records -> protobuf), one line per
optimizer step, and the run's outcome (summary.json)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel, Field

from clients.step_rollouts import StepTask
from clients.train.config import Budget
from sciproto.client.rollouts import FINISH_REASON_TO_PB, RolloutGroup, RolloutRecord, RolloutStatus
from sciproto.pb import common_pb2, learner_pb2, policy_pb2

log = logging.getLogger(__name__)

_STATUS_TO_PB = {
    RolloutStatus.SCORED: common_pb2.REWARD_STATUS_SCORED,
    RolloutStatus.UNSCORED: common_pb2.REWARD_STATUS_UNSCORED,
    RolloutStatus.INFRA_ERROR: common_pb2.REWARD_STATUS_INFRA_ERROR,
}


def rollout_to_pb(record: RolloutRecord) -> learner_pb2.Rollout:
    """The learner's message for one rollout record, finish reasons and step rewards included."""
    return learner_pb2.Rollout(
        sample_index=record.sample,
        episode=record.episode,
        token_ids=record.token_ids,
        loss_mask=record.loss_mask,
        rollout_logprobs=record.logprobs,
        version_spans=[
            common_pb2.VersionSpan(start=s, end=e, policy_version=v)
            for s, e, v in record.version_spans
        ],
        reward=common_pb2.Reward(
            value=record.reward,
            components=record.reward_components,
            status=_STATUS_TO_PB[record.status],
            detail=record.reward_detail or (record.error or ""),
        ),
        turns=record.steps,
        turn_finish_reasons=[FINISH_REASON_TO_PB[reason] for reason in record.turn_finish_reasons],
        step_rewards=record.step_rewards,
        sampling_spans=[
            learner_pb2.SamplingSpan(start=start, end=end, sampling=policy_pb2.SamplingParams(
                temperature=temperature, top_p=top_p, top_k=top_k))
            for start, end, temperature, top_p, top_k in record.sampling_spans
        ],
    )


def group_to_pb(group_id: str, records: Sequence[RolloutRecord],
                objective: int = learner_pb2.TRAIN_OBJECTIVE_GRPO) -> learner_pb2.RolloutGroup:
    """The learner's message for one group; rollouts without tokens (failed before the policy
    spoke) carry nothing to train and are left out."""
    first = records[0]
    return learner_pb2.RolloutGroup(
        group_id=group_id,
        env=first.env,
        task_id=f"{first.split}/{first.index}",
        rollouts=[rollout_to_pb(r) for r in records if r.token_ids],
        objective=objective,
    )


def with_epoch(group: RolloutGroup, epoch: int) -> tuple[str, list[RolloutRecord]]:
    """The group's id for this pass over the split, and its records renamed to match: a step
    group's id adds its step, `<env>/<split>/<index>#<epoch>/step<k>`. The segments of one
    episode keep what follows the sample in their ids (`/segment1`) and are renamed together."""
    group_id = f"{group.task.group_id}#{epoch}" + ("" if group.step is None else f"/step{group.step}")

    def renamed(r: RolloutRecord) -> RolloutRecord:
        sample_id = f"{r.group_id}/{r.sample}"
        tail = r.rollout_id[len(sample_id):] if r.rollout_id.startswith(sample_id) else ""
        return r.model_copy(update={"group_id": group_id, "rollout_id": f"{group_id}/{r.sample}{tail}",
                                    "episode": f"{group_id}/{r.sample}" if r.episode else ""})

    return group_id, [renamed(r) for r in group.rollouts]


class StepRecord(BaseModel):
    step: int
    policy_version: int
    reward_mean: float
    policy_lag_mean: float
    groups: int
    seconds: float  # since training started
    # rollout.grouping step: forks opened and closed by the rollout client up to this step.
    forks_opened: int | None = None
    forks_closed: int | None = None
    # What the step trained: "grpo", or "sft" (a phase on demonstrations: reward_mean is nan).
    objective: str = "grpo"
    sft_loss: float | None = None
    sft_token_accuracy: float | None = None


class TrainOutcome(BaseModel):
    """What a run did; written to summary.json."""

    run_dir: str
    steps: list[StepRecord] = []
    seconds: float = 0.0
    groups_generated: int = 0
    demonstrations_sent: int = 0  # sft phases: demonstration groups sent to the learner
    groups_refused: dict[str, int] = {}
    # What became of the groups generated (see clients.train.flow): fate -> groups, and the
    # groups still unsettled when the run stopped (generated, not yet consumed or dropped).
    groups_settled: dict[str, int] = {}
    groups_pending: int = 0
    groups_resent: int = 0  # sent again on a new stream after the learner's stream broke
    learner_reconnects: int = 0
    step_failures: int = 0  # learner steps that failed and gave their groups back
    first_step_s: float | None = None  # seconds to the first optimizer step result
    # rollout.grouping step: forks_opened, forks_closed, step_groups, step_group_reward_std (mean
    # over groups), prompt_tokens_per_turn_mean / _max (every Generate), tasks_failed.
    step_groups: dict[str, float] = {}
    # Per-task statistics (clients.train.task_stats.TaskStats.summary): tasks seen, groups, tasks set
    # aside at the end (all, solved, unsolved), turns of set-aside tasks passed over and revisited,
    # and the revisits that came back mixed.
    task_stats: dict[str, int] = {}
    # Every fate the client recorded per group id (one each); not written to summary.json.
    group_fates: dict[str, list[str]] = Field(default_factory=dict, exclude=True)
    completion_tokens: int = 0
    sft_seconds: float = 0.0  # seconds of the sft phases, before rollouts began
    # Seconds during which no group was being generated (the rollout client waited on the learner).
    generation_idle_s: float = 0.0
    # Where the roles ran (clients.train.placement), and the learner's seconds by phase over its
    # steps (metrics.jsonl): train_s, weight_sync_s, wait_rollouts_s and, colocated, policy_held_s.
    placement: str = ""
    learner_seconds: dict[str, float] = {}
    # The policy servers' rate alone before the first rollout (clients.train.calibration): tokens,
    # seconds, servers, groups, samples, tokens_per_s; empty when skipped.
    calibration: dict[str, int | float] = {}
    stopped_by: str = ""
    checkpoint: str = ""
    metrics: str = ""
    plot: str = ""
    rollouts: str = ""

    @property
    def tokens_per_s(self) -> float:
        """Completion tokens per second of generating: from the end of the sft phases on."""
        return self._tokens_per(self.seconds - self.sft_seconds)

    @property
    def tokens_per_s_generating(self) -> float:
        """Completion tokens per second while some group was being generated (less the idle waits
        on the learner): the rate to set beside the calibration's rate alone."""
        return self._tokens_per(self.seconds - self.sft_seconds - self.generation_idle_s)

    def _tokens_per(self, seconds: float) -> float:
        return self.completion_tokens / seconds if seconds > 0 else 0.0


def budget_spent(budget: Budget, steps: Sequence[StepRecord]) -> str:
    """Which step limit of the budget the run has reached ("" while none)."""
    if budget.max_steps is not None and steps and steps[-1].step >= budget.max_steps:
        return "max_steps"
    recent = steps[-budget.target_window :]
    if (
        budget.target_reward is not None
        and len(recent) == budget.target_window
        and sum(s.reward_mean for s in recent) / len(recent) >= budget.target_reward
    ):
        return "target_reward"
    return ""


@dataclass
class StepGroupTally:
    """rollout.grouping step: what the tasks played so far add up to (`TrainOutcome.step_groups`)."""

    totals: dict[str, float] = field(default_factory=lambda: {
        "forks_opened": 0, "forks_closed": 0, "step_groups": 0, "tasks_failed": 0})
    reward_stds: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)

    def add(self, played: StepTask) -> None:
        totals = self.totals
        totals["forks_opened"] += played.stats.forks_opened
        totals["forks_closed"] += played.stats.forks_closed
        totals["step_groups"] += played.stats.groups
        totals["tasks_failed"] += played.error is not None
        if played.context_full is not None and not played.groups:
            totals["tasks_context_full"] = totals.get("tasks_context_full", 0) + 1
            if totals["tasks_context_full"] == 1:
                log.warning("%s: its first prompt does not fit the model, so it gives no step group: %s",
                            played.task.group_id, played.context_full)
        self.reward_stds += played.stats.reward_stds
        self.prompt_tokens += played.prompt_tokens
        totals["step_group_reward_std"] = (sum(self.reward_stds) / len(self.reward_stds)
                                           if self.reward_stds else 0.0)
        if self.prompt_tokens:
            totals["prompt_tokens_per_turn_mean"] = sum(self.prompt_tokens) / len(self.prompt_tokens)
            totals["prompt_tokens_per_turn_max"] = max(self.prompt_tokens)


__all__ = ["StepGroupTally", "StepRecord", "TrainOutcome", "budget_spent", "group_to_pb", "rollout_to_pb", "with_epoch"]
