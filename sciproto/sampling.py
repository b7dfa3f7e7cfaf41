"""How a policy samples a turn, and how an episode is played: the one definition every component
reads (the configs of `train`, `collect` and `eval`, the gateway, the policy server and its
backends, the learner).

The distribution a token is drawn from, given the model's logits l over the vocabulary V:

    z      = l / T                                   temperature T > 0 (T = 0: greedy, below)
    top-k  : keep the tokens whose z is at least the k-th largest z (ties at the k-th kept);
             k = 0 (or k >= |V|) keeps every token
    top-p  : sort the kept tokens by probability, ascending; drop each token whose cumulative
             probability (renormalised over the kept tokens, itself included) is <= 1 - p; the
             most likely token always stays
    log p  = log_softmax(z over the kept tokens)     -inf outside them

in that order, as vLLM's sampler applies them (`vllm/v1/sample/ops/topk_topp_sampler.py`). Both
backends report log p of the sampled token (the "processed" log-probability), and the learner
recomputes the kept set from its own logits with the same rule, so pi_old / mu is 1 for the
weights that sampled. A greedy turn (T = 0) reports the raw log_softmax(l) of its argmax; it
trains as T = 1 without truncation.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from sciproto.client.retries import Deadlines, RetryPolicy


class Distribution(NamedTuple):
    """What a token was drawn from: the settings of `Sampling` that change the distribution
    (max_tokens, stop and seed do not). Greedy sampling (temperature 0) reads as (1, 1, 0): its
    reported log-probability is the untempered, untruncated one."""

    temperature: float
    top_p: float
    top_k: int


UNTRANSFORMED = Distribution(1.0, 1.0, 0)


def check_sampling(temperature: float, top_p: float, top_k: int) -> None:
    """The range check of the three settings that shape the distribution; ValueError says which
    value is wrong and what to use instead."""
    if not 0 <= temperature < math.inf:  # also refuses NaN, which would sample NaN logprobs
        raise ValueError(f"temperature is {temperature}; use 0 (greedy) or a positive finite value")
    if not 0 < top_p <= 1:  # NaN fails too
        raise ValueError(f"top_p is {top_p}; it must be in (0, 1] (1 keeps every token)")
    if top_k < 0:
        raise ValueError(f"top_k is {top_k}; use 0 (every token) or a positive count")


class Sampling(BaseModel):
    """How each turn is sampled."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(1.0, description="Softmax temperature: logits / temperature; 0 is greedy")
    top_p: float = Field(
        1.0, description="Nucleus sampling: the smallest set of most likely tokens with this mass (1: all)")
    top_k: int = Field(0, description="Only the k most likely tokens (ties at the k-th kept); 0: all")
    max_tokens: int = Field(256, ge=1, description="Most new tokens per turn")
    stop: list[str] = Field(default_factory=list, description="A turn ends after any of these strings")
    seed: int | None = Field(None, description="Same seed, prompt and weights: same samples")

    @model_validator(mode="after")
    def _in_range(self) -> Sampling:
        check_sampling(self.temperature, self.top_p, self.top_k)
        return self

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, stop: list[str]) -> list[str]:
        if any(not s for s in stop):
            raise ValueError("stop holds an empty string; remove it")
        return stop

    @property
    def distribution(self) -> Distribution:
        """The transformation a token sampled with these settings was drawn under."""
        if self.temperature == 0:
            return UNTRANSFORMED
        return Distribution(self.temperature, self.top_p, self.top_k)


SAMPLING_DEFAULTS = Sampling()


def distribution_from_pb(message: Any) -> Distribution:
    """The distribution a `sciproto.v1.SamplingParams` message asks for, unset fields read as
    their defaults; ValueError when out of range."""
    temperature = message.temperature if message.HasField("temperature") else SAMPLING_DEFAULTS.temperature
    top_p = message.top_p if message.HasField("top_p") else SAMPLING_DEFAULTS.top_p
    top_k = message.top_k if message.HasField("top_k") else SAMPLING_DEFAULTS.top_k
    check_sampling(temperature, top_p, top_k)
    if temperature == 0:
        return UNTRANSFORMED
    return Distribution(temperature, top_p, top_k)


class EpisodeSettings(BaseModel):
    """How one episode is played: its sampling, its limits and its retries (train's `rollout`, and
    the settings of `collect` and `eval`)."""

    model_config = ConfigDict(extra="forbid")

    sampling: Sampling = Field(default_factory=Sampling)
    max_steps: int = Field(8, ge=1, description="Most environment Steps per episode")
    max_tokens: int = Field(4096, ge=1, description="Most tokens per trajectory (prompt, environment and policy)")
    retries: RetryPolicy = Field(default_factory=RetryPolicy)
    deadlines: Deadlines = Field(default_factory=Deadlines)


__all__ = [
    "SAMPLING_DEFAULTS",
    "UNTRANSFORMED",
    "Distribution",
    "EpisodeSettings",
    "Sampling",
    "check_sampling",
    "distribution_from_pb",
]
