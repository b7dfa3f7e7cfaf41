"""The figures of an evaluation pass, computed from its rollouts (no servers needed).

- pass@1 and pass@k over tasks, with a Wilson score interval: each task's estimate lies in
  [0, 1], so its variance is at most p(1 - p) and the Bernoulli interval over the tasks is a valid
  (conservative, for k > 1 samples) interval for the mean;
- per-task pass rates, and from K >= 2 samples the reward analysis GRPO cares about: the fraction
  of tasks whose outcomes are mixed (0 < p < 1), whose rewards differ at all (the groups GRPO can
  learn from: an all-equal group has zero advantage), and a histogram of passes per task;
- token, turn and time statistics, and why episodes ended (`end_reason`).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from enum import StrEnum

from pydantic import BaseModel, Field

from clients.curriculum import Curriculum
from clients.summary import ks_for, pass_at_k
from sciproto.client.rollouts import RolloutRecord, RolloutStatus

# The tool message an env server writes for a call it could not run (env_servers.convert).
INVALID_CALL_PREFIX = "Invalid tool call"


class EndReason(StrEnum):
    ANSWERED = "answered"  # the environment ended the episode (an answer was submitted)
    INVALID_TOOL_CALL = "invalid_tool_call"  # the last turn's tool call was malformed or refused
    TOKEN_LIMIT = "token_limit"  # the trajectory reached its token budget (or the model's context)
    STEP_LIMIT = "step_limit"  # max_steps turns without the environment ending the episode
    TRUNCATED = "truncated"  # cut off below both budgets: by the environment, or the model's context
    INFRA_ERROR = "infra_error"  # the environment or policy failed: not the agent's outcome


def end_reason(record: RolloutRecord, max_steps: int, max_tokens: int) -> EndReason:
    """Why the episode ended, judged from its last turn and budgets (first match wins)."""
    if record.status is RolloutStatus.INFRA_ERROR:
        return EndReason.INFRA_ERROR
    last_assistant = max((i for i, m in enumerate(record.messages) if m.role == "assistant"), default=None)
    if last_assistant is not None:
        message = record.messages[last_assistant]
        malformed = not message.tool_calls and "<tool_call>" in (message.content or "")
        refused = any(m.role == "tool" and (m.content or "").startswith(INVALID_CALL_PREFIX)
                      for m in record.messages[last_assistant + 1:])
        if malformed or refused:
            return EndReason.INVALID_TOOL_CALL
    if record.terminated:
        return EndReason.ANSWERED
    if record.tokens.prompt + record.tokens.completion >= max_tokens:
        return EndReason.TOKEN_LIMIT
    if record.steps >= max_steps:
        return EndReason.STEP_LIMIT
    return EndReason.TRUNCATED


def wilson_interval(successes: float, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a proportion; (0, 1) when there are no trials."""
    if trials == 0:
        return 0.0, 1.0
    z = statistics.NormalDist().inv_cdf(0.5 + confidence / 2)
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z / (1 + z * z / trials) * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials))
    low = 0.0 if successes <= 0 else max(0.0, centre - half)  # exact ends: no rounding residue
    high = 1.0 if successes >= trials else min(1.0, centre + half)
    return low, high


class Estimate(BaseModel):
    value: float
    low: float = Field(description="Lower end of the confidence interval")
    high: float = Field(description="Upper end of the confidence interval")
    tasks: int = Field(description="Tasks averaged")


class Distribution(BaseModel):
    mean: float
    p50: float
    p90: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        if not values:
            return cls(mean=0.0, p50=0.0, p90=0.0, max=0.0)
        ordered = sorted(values)
        pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]
        return cls(mean=round(statistics.fmean(ordered), 3), p50=pick(0.5), p90=pick(0.9), max=ordered[-1])


class TaskOutcome(BaseModel):
    index: int
    samples: int = Field(description="SCORED samples")
    passes: int
    pass_rate: float
    mean_reward: float
    rewards_differ: bool = Field(description="Not all rewards equal: a GRPO group on this task has a signal")


class RewardAnalysis(BaseModel):
    """From K >= 2 samples per task: how much a GRPO group on these tasks can learn."""

    samples: int
    frac_mixed: float = Field(description="Tasks with 0 < pass rate < 1")
    frac_rewards_differ: float = Field(description="Tasks whose sample rewards are not all equal (GRPO signal)")
    frac_all_pass: float
    frac_all_fail: float
    passes_histogram: dict[str, int] = Field(description="Number of tasks with c passes out of K, for c = 0..K")


class PassReport(BaseModel):
    """One pass over the tasks: greedy (1 sample, temperature 0) or sampled (K samples)."""

    name: str
    temperature: float
    samples: int
    seed: int | None
    tasks: int
    rollouts: int
    scored: int
    unscored: int
    infra_errors: int
    mean_reward: float | None
    pass_at: dict[str, Estimate] = Field(description="pass@k for k = 1, 2, 4, ..., K")
    end_reasons: dict[str, int]
    completion_tokens: Distribution = Field(description="Per rollout")
    prompt_tokens: Distribution = Field(description="Per rollout: prompt and environment tokens")
    turns: Distribution = Field(description="Environment steps per rollout")
    turns_histogram: dict[str, int]
    seconds: Distribution = Field(description="Wall time per rollout")
    wall_s: float
    completion_tokens_per_s: float = Field(description="Completion tokens of the pass over its wall time")
    reward_analysis: RewardAnalysis | None = Field(None, description="Only with K >= 2 samples")
    tool_call_reply_frac: float | None = Field(
        None, description="Share of the policy's replies holding a well-formed tool call (one the policy server"
                          " parsed; a malformed block stays in the reply's text); None when no reply")
    tool_calls: Distribution = Field(default_factory=lambda: Distribution.of([]),
                                     description="Well-formed tool calls per rollout")
    tool_calls_by_name: dict[str, int] = Field(default_factory=dict, description="Tool calls of the pass, by tool")
    per_task: list[TaskOutcome]


def analyse_pass(name: str, records: Iterable[RolloutRecord], *, temperature: float, samples: int,
                 seed: int | None, max_steps: int, max_tokens: int, success_reward: float, wall_s: float,
                 confidence: float = 0.95) -> PassReport:
    rollouts = list(records)
    by_task: dict[int, list[RolloutRecord]] = defaultdict(list)
    for record in rollouts:
        by_task[record.index].append(record)
    per_task: list[TaskOutcome] = []
    by_k: dict[int, list[float]] = defaultdict(list)
    for index in sorted(by_task):
        scored = [r for r in by_task[index] if r.status is RolloutStatus.SCORED]
        if not scored:
            continue  # every sample failed or was ungraded: no outcome to count
        passes = sum(r.reward >= success_reward for r in scored)
        rewards = [r.reward for r in scored]
        per_task.append(TaskOutcome(index=index, samples=len(scored), passes=passes,
                                    pass_rate=round(passes / len(scored), 4),
                                    mean_reward=round(statistics.fmean(rewards), 4),
                                    rewards_differ=len(set(rewards)) > 1))
        for k in ks_for(len(scored)):
            if k <= samples:
                by_k[k].append(pass_at_k(len(scored), passes, k))
    pass_at = {}
    for k, values in sorted(by_k.items()):
        low, high = wilson_interval(sum(values), len(values), confidence)
        pass_at[f"pass@{k}"] = Estimate(value=round(sum(values) / len(values), 4), low=round(low, 4),
                                        high=round(high, 4), tasks=len(values))
    scored_all = [r for r in rollouts if r.status is RolloutStatus.SCORED]
    reasons = Counter(end_reason(r, max_steps, max_tokens).value for r in rollouts)
    judged = [r for r in rollouts if r.status is not RolloutStatus.INFRA_ERROR]
    completion = sum(r.tokens.completion for r in rollouts)
    return PassReport(
        name=name, temperature=temperature, samples=samples, seed=seed, tasks=len(by_task),
        rollouts=len(rollouts), scored=len(scored_all),
        unscored=sum(r.status is RolloutStatus.UNSCORED for r in rollouts),
        infra_errors=sum(r.status is RolloutStatus.INFRA_ERROR for r in rollouts),
        mean_reward=round(statistics.fmean(r.reward for r in scored_all), 4) if scored_all else None,
        pass_at=pass_at,
        end_reasons={reason.value: reasons.get(reason.value, 0) for reason in EndReason},
        completion_tokens=Distribution.of([r.tokens.completion for r in judged]),
        prompt_tokens=Distribution.of([r.tokens.prompt for r in judged]),
        turns=Distribution.of([r.steps for r in judged]),
        turns_histogram={str(k): v for k, v in sorted(Counter(r.steps for r in judged).items())},
        seconds=Distribution.of([r.seconds for r in judged]),
        wall_s=round(wall_s, 3),
        completion_tokens_per_s=round(completion / wall_s, 3) if wall_s > 0 else 0.0,
        reward_analysis=reward_analysis(per_task, samples) if samples >= 2 else None,
        **tool_use(judged),
        per_task=per_task,
    )


def tool_use(records: Sequence[RolloutRecord]) -> dict[str, object]:
    """How the policy called tools: the share of its replies with a well-formed call, calls per
    rollout, calls by tool name."""
    replies = [m for r in records for m in r.messages if m.role == "assistant"]
    names = Counter(call.name for m in replies for call in m.tool_calls)
    return {
        "tool_call_reply_frac": round(sum(bool(m.tool_calls) for m in replies) / len(replies), 4) if replies else None,
        "tool_calls": Distribution.of([sum(len(m.tool_calls) for m in r.messages if m.role == "assistant")
                                       for r in records]),
        "tool_calls_by_name": dict(sorted(names.items())),
    }


def reward_analysis(per_task: Sequence[TaskOutcome], samples: int) -> RewardAnalysis:
    count = len(per_task) or 1
    histogram = Counter(t.passes for t in per_task)
    return RewardAnalysis(
        samples=samples,
        frac_mixed=round(sum(0 < t.passes < t.samples for t in per_task) / count, 4),
        frac_rewards_differ=round(sum(t.rewards_differ for t in per_task) / count, 4),
        frac_all_pass=round(sum(t.passes == t.samples for t in per_task) / count, 4),
        frac_all_fail=round(sum(t.passes == 0 for t in per_task) / count, 4),
        passes_histogram={str(c): histogram.get(c, 0) for c in range(samples + 1)},
    )


def curriculum_of(report: PassReport, env: str, split: str, *, min_pass_rate: float = 0.0,
                  max_pass_rate: float = 1.0, source: dict | None = None) -> Curriculum:
    """The tasks of a sampled pass whose pass rate lies strictly between the bounds (by default the
    mixed ones), in split order."""
    kept = [t for t in report.per_task if min_pass_rate < t.pass_rate < max_pass_rate]
    return Curriculum(env=env, split=split, indices=[t.index for t in kept],
                      pass_rates={str(t.index): t.pass_rate for t in kept}, samples=report.samples,
                      min_pass_rate=min_pass_rate, max_pass_rate=max_pass_rate, source=source or {})


__all__ = ["EndReason", "Estimate", "PassReport", "RewardAnalysis", "TaskOutcome", "analyse_pass",
           "curriculum_of", "end_reason", "tool_use", "wilson_interval"]
