"""The learner's wire layer, inbound: RolloutGroup and Rollout messages read into the trainer's
RolloutGroup and TrainSample, or InvalidGroup saying what the sender must fix."""

from __future__ import annotations

from pydantic import ValidationError

from learner.types import FinishReason, Objective, RewardStatus, RolloutGroup, TrainSample
from sciproto.pb import common_pb2, learner_pb2, policy_pb2
from sciproto.sampling import distribution_from_pb

_STATUS_FROM_PB = {
    common_pb2.REWARD_STATUS_SCORED: RewardStatus.SCORED,
    common_pb2.REWARD_STATUS_UNSCORED: RewardStatus.UNSCORED,
    common_pb2.REWARD_STATUS_UNSPECIFIED: RewardStatus.UNSCORED,  # the contract: read as UNSCORED
    common_pb2.REWARD_STATUS_INFRA_ERROR: RewardStatus.INFRA_ERROR,
}

_FINISH_FROM_PB = {
    policy_pb2.FINISH_REASON_UNSPECIFIED: FinishReason.UNSPECIFIED,
    policy_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    policy_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    policy_pb2.FINISH_REASON_ABORT: FinishReason.ABORT,
}


class InvalidGroup(ValueError):
    """A RolloutGroup message that cannot be trained on; the message says what to fix."""


def sample_from_pb(rollout: learner_pb2.Rollout, vocab_size: int, *, sft: bool = False) -> TrainSample:
    """A proto Rollout as a TrainSample: version spans become one version per trained token
    (a demonstration, `sft`, needs none: its uncovered trained tokens count as version 0)."""
    n = len(rollout.token_ids)
    if n and max(rollout.token_ids) >= vocab_size:
        raise InvalidGroup(
            f"sample {rollout.sample_index}: token id {max(rollout.token_ids)} is outside the "
            f"model's vocabulary of {vocab_size}; send ids the policy server of this model produced"
        )
    versions = [-1] * n
    for span in rollout.version_spans:
        if not 0 <= span.start < span.end <= n:
            raise InvalidGroup(
                f"sample {rollout.sample_index}: version span [{span.start}, {span.end}) "
                f"lies outside token_ids [0, {n})"
            )
        versions[span.start : span.end] = [span.policy_version] * (span.end - span.start)
    uncovered = [i for i, m in enumerate(rollout.loss_mask) if m == 1 and i < n and versions[i] < 0]
    if sft:
        for i in uncovered:
            versions[i] = 0
    elif uncovered:
        raise InvalidGroup(
            f"sample {rollout.sample_index}: trained token {uncovered[0]} lies in no "
            "version span; every token with loss_mask 1 needs the version that sampled it"
        )
    versions = [
        v if i < len(rollout.loss_mask) and rollout.loss_mask[i] == 1 else -1
        for i, v in enumerate(versions)
    ]
    try:
        return TrainSample(
            token_ids=list(rollout.token_ids),
            loss_mask=list(rollout.loss_mask),
            rollout_logprobs=list(rollout.rollout_logprobs),
            policy_versions=versions,
            reward=rollout.reward.value,
            reward_status=_reward_status(rollout),
            sample_index=rollout.sample_index,
            episode=rollout.episode,
            turn_finish_reasons=_finish_reasons(rollout),
            step_rewards=list(rollout.step_rewards),
            sampling_spans=_sampling_spans(rollout),
        )
    except ValidationError as error:
        reasons = "; ".join(e["msg"] for e in error.errors())
        raise InvalidGroup(f"sample {rollout.sample_index}: {reasons}") from None


def _sampling_spans(rollout: learner_pb2.Rollout) -> list[tuple[int, int, float, float, int]]:
    """Each span's distribution (sciproto.sampling: unset fields read as their defaults, a greedy
    turn as untransformed); InvalidGroup names a span the learner cannot train under."""
    spans = []
    for number, span in enumerate(rollout.sampling_spans):
        try:
            distribution = distribution_from_pb(span.sampling)
        except ValueError as error:
            raise InvalidGroup(f"sample {rollout.sample_index}: sampling_spans[{number}]: {error}") from None
        spans.append((span.start, span.end, *distribution))
    return spans


def _reward_status(rollout: learner_pb2.Rollout) -> RewardStatus:
    status = _STATUS_FROM_PB.get(rollout.reward.status)
    if status is None:  # an enum number from a newer contract, or garbage
        raise InvalidGroup(
            f"sample {rollout.sample_index}: reward.status {rollout.reward.status} is not a known "
            "RewardStatus; use REWARD_STATUS_SCORED, _UNSCORED or _INFRA_ERROR"
        )
    return status


def _finish_reasons(rollout: learner_pb2.Rollout) -> list[FinishReason]:
    reasons = []
    for turn, number in enumerate(rollout.turn_finish_reasons):
        if number not in _FINISH_FROM_PB:  # a reason from a newer contract: it may mean a cut
            raise InvalidGroup(
                f"sample {rollout.sample_index}: turn_finish_reasons[{turn}] = {number} is not a "
                "known FinishReason; use FINISH_REASON_STOP, _LENGTH, _ABORT or _UNSPECIFIED"
            )
        reasons.append(_FINISH_FROM_PB[number])
    return reasons


def group_from_pb(group: learner_pb2.RolloutGroup, vocab_size: int) -> RolloutGroup:
    """A proto RolloutGroup as the trainer's RolloutGroup; InvalidGroup says what is wrong."""
    if not group.group_id:
        raise InvalidGroup("group_id is empty; every group needs a unique id")
    if not group.rollouts:
        raise InvalidGroup(f"group {group.group_id} has no rollouts")
    objective = _OBJECTIVE_FROM_PB.get(group.objective)
    if objective is None:
        raise InvalidGroup(f"group {group.group_id}: objective {group.objective} is not a known TrainObjective;"
                           " use TRAIN_OBJECTIVE_GRPO or TRAIN_OBJECTIVE_SFT")
    sft = objective is Objective.SFT
    samples = [sample_from_pb(rollout, vocab_size, sft=sft) for rollout in group.rollouts]
    if sft and not any(s.num_trained_tokens and s.reward_status is not RewardStatus.INFRA_ERROR for s in samples):
        raise InvalidGroup(f"sft group {group.group_id} has no trainable token: every sample is INFRA_ERROR"
                           " or has loss_mask all 0; mark the demonstration's assistant tokens with loss_mask 1")
    return RolloutGroup(group_id=group.group_id, task=group.task_id or group.env, samples=samples,
                        objective=objective)


_OBJECTIVE_FROM_PB = {
    learner_pb2.TRAIN_OBJECTIVE_UNSPECIFIED: Objective.GRPO,
    learner_pb2.TRAIN_OBJECTIVE_GRPO: Objective.GRPO,
    learner_pb2.TRAIN_OBJECTIVE_SFT: Objective.SFT,
}
