"""The learner's input: sampled completions grouped by prompt, as the rollout clients deliver them."""

from __future__ import annotations

import math
from enum import Enum

from pydantic import BaseModel, Field, model_validator

from sciproto.sampling import check_sampling


class RewardStatus(str, Enum):
    """Where a reward came from; only SCORED rewards train the policy."""

    SCORED = "SCORED"
    # The environment returned no verdict (e.g. no verifier for this task): not a signal.
    UNSCORED = "UNSCORED"
    # The environment failed: the sample is masked out, never read as a wrong answer.
    INFRA_ERROR = "INFRA_ERROR"


class FinishReason(str, Enum):
    """Why a policy turn ended (the policy's FinishReason)."""

    UNSPECIFIED = "UNSPECIFIED"
    STOP = "STOP"  # an end-of-turn token or a stop string
    LENGTH = "LENGTH"  # cut by its token limit: max_tokens, the trajectory's budget or the context
    ABORT = "ABORT"


class TrainSample(BaseModel):
    """One sampled completion: the prompt and every turn as one token sequence.

    All per-token lists are aligned with `token_ids`.
    """

    token_ids: list[int]
    # 1 where the policy produced the token and it is trained on; 0 for prompt/environment tokens.
    loss_mask: list[int]
    # mu: the policy server's logprob of each sampled token (0 where loss_mask is 0).
    rollout_logprobs: list[float]
    # The policy version that sampled each token (-1 where loss_mask is 0).
    policy_versions: list[int]
    reward: float
    reward_status: RewardStatus = RewardStatus.SCORED
    sample_index: int = 0
    # Samples of a group with the same non-empty episode are the segments of one episode: one
    # sample in the group's statistics, each segment trained with its advantage.
    episode: str = ""
    # Why each policy turn ended, in turn order; empty when the sender did not say.
    turn_finish_reasons: list[FinishReason] = []
    # The environment's reward of each step, in order (`reward` is the trajectory's grade); empty
    # when the sender did not say.
    step_rewards: list[float] = []
    # (start, end, temperature, top_p, top_k): tokens [start, end) were sampled from that
    # distribution (sciproto/sampling.py; greedy turns read (1, 1, 0)). Trained tokens outside
    # every span were sampled at learner.grpo.temperature without truncation.
    sampling_spans: list[tuple[int, int, float, float, int]] = []

    @model_validator(mode="after")
    def _check_alignment(self) -> TrainSample:
        n = len(self.token_ids)
        if n == 0:
            raise ValueError("TrainSample.token_ids is empty: a sample needs at least one token")
        for name in ("loss_mask", "rollout_logprobs", "policy_versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"TrainSample.{name} has {len(getattr(self, name))} entries but token_ids has "
                    f"{n}: every per-token list must be aligned with token_ids"
                )
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError("TrainSample.loss_mask must contain only 0 and 1")
        if self.loss_mask[0] == 1:
            raise ValueError(
                "TrainSample.loss_mask[0] is 1: the first token has no context to be predicted "
                "from; a sample must start with at least one prompt token"
            )
        if any(v < 0 for v, m in zip(self.policy_versions, self.loss_mask) if m == 1):
            raise ValueError("TrainSample.policy_versions must be >= 0 wherever loss_mask is 1")
        # One NaN would turn the whole optimizer step, and every policy server after the push, NaN.
        if not all(math.isfinite(lp) for lp in self.rollout_logprobs):
            raise ValueError("TrainSample.rollout_logprobs must all be finite (no NaN or infinity)")
        if self.reward_status is RewardStatus.SCORED and not math.isfinite(self.reward):
            raise ValueError("TrainSample.reward must be finite for a SCORED sample; "
                             "mark a sample that could not be scored UNSCORED or INFRA_ERROR")
        for start, end, temperature, top_p, top_k in self.sampling_spans:
            if not 0 <= start < end <= n:
                raise ValueError(f"TrainSample.sampling_spans: span [{start}, {end}) lies outside token_ids [0, {n})")
            try:
                check_sampling(temperature, top_p, top_k)
            except ValueError as error:
                raise ValueError(f"TrainSample.sampling_spans: span [{start}, {end}): {error}") from None
            if temperature == 0:
                raise ValueError(f"TrainSample.sampling_spans: span [{start}, {end}) has temperature 0; a greedy"
                                 " turn's logprobs are untempered and untruncated: send it as 1, 1, 0")
        if not all(math.isfinite(r) for r in self.step_rewards):
            raise ValueError("TrainSample.step_rewards must all be finite (no NaN or infinity)")
        return self

    @property
    def cut_by_length(self) -> bool:
        """A policy turn of this sample was cut by its token limit (DAPO's "overlong" sample)."""
        return FinishReason.LENGTH in self.turn_finish_reasons

    @property
    def num_trained_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def oldest_version(self) -> int | None:
        """The oldest policy version among the trained tokens (None when nothing is trained)."""
        versions = [v for v, m in zip(self.policy_versions, self.loss_mask) if m == 1]
        return min(versions) if versions else None


class Objective(str, Enum):
    """What a group trains (TrainObjective)."""

    GRPO = "grpo"
    SFT = "sft"  # demonstrations: cross-entropy on the trained tokens (learner/sft.py)


class RolloutGroup(BaseModel):
    """The n samples of one prompt: the unit GRPO normalises advantages over; with objective SFT,
    demonstrations trained by cross-entropy (no advantage, no staleness)."""

    group_id: str
    task: str
    samples: list[TrainSample] = Field(min_length=1)
    objective: Objective = Objective.GRPO

    @property
    def oldest_version(self) -> int | None:
        """The oldest policy version among the tokens that will be trained (SCORED samples);
        None for an SFT group, which no policy version sampled."""
        if self.objective is Objective.SFT:
            return None
        versions = [
            v
            for s in self.samples
            if s.reward_status is RewardStatus.SCORED and (v := s.oldest_version) is not None
        ]
        return min(versions) if versions else None
