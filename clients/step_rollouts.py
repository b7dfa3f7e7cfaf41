"""Step-level groups as training data: each step group of a task becomes one rollout group, its
shared state the prompt and one completion per alternative (`rollout.grouping: step`).

    task = await run_step_task(TaskKey("notebook", "train", 3), env, policy, settings, grouping,
                               options={"observation": "state"})
    task.groups   # RolloutGroup(step=k) per step group, in step order
    task.stats    # forks opened / closed, groups, reward std per group, prompt tokens per turn

A sample i of the group of step k is one sequence: the prompt's tokens as the policy saw them
(loss mask 0) and the completion it sampled for fork i (mask 1, with its logprobs and versions);
its reward is branch i's score (the step's reward, or the branch's return with scoring "rollout").
The learner normalises advantages within the group, so A_i compares alternatives of the same
state, and every sample starts with the same prompt: the shared-prefix path runs it once.

Each Generate of a group samples n completions of one prompt and sends no `previous_token_ids`:
a turn's prompt is rendered whole (with the notebook's state view it does not extend the previous
turn's anyway). Failures: the groups finished before an env or policy call failed are kept and
the task reports the error; authentication failures and a task the environment refuses raise.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from clients.agent import (
    FATAL_ERRORS,
    TASK_REASONS,
    AgentSettings,
    EnvPool,
    PolicyPool,
    TaskRejected,
    generate,
)
from clients.step_groups import (
    BranchFailed,
    EpisodeOver,
    StepGroup,
    StepGrouping,
    StepGroupStats,
    run_step_groups,
)
from sciproto.client.policy import GenerationGroup
from sciproto.client.rollouts import (
    MessageRecord,
    RolloutGroup,
    RolloutRecord,
    RolloutStatus,
    TaskKey,
    Trajectory,
    finish_reason_name,
)
from sciproto.errors import InvalidArgument, Reason, SciprotoError, Unavailable
from sciproto.pb import common_pb2, policy_pb2

log = logging.getLogger(__name__)


class StepGroupSettings(BaseModel):
    """rollout.grouping step: the bounds of step-level groups (clients.step_groups)."""

    model_config = ConfigDict(extra="forbid")

    group_size: int = Field(4, ge=2, description="Forks per step group, one action each: the GRPO group")
    max_depth: int = Field(8, ge=1, description="Most steps of a task's base rollout, grouped or not")
    fork_budget: int = Field(32, ge=0, description="Most forks one task may open (scoring rollouts included)")
    scoring: Literal["step_reward", "rollout"] = Field(
        "step_reward",
        description="Score a branch by its step reward, or by its return played out to the end on a fork",
    )
    branch_depth: int = Field(4, ge=0, description="scoring rollout: most steps played after the group's step")

    @model_validator(mode="after")
    def _budget_pays_for_a_group(self) -> StepGroupSettings:
        per_group = self.group_size * (2 if self.scoring == "rollout" else 1)
        if self.fork_budget < per_group:
            raise ValueError(
                f"step_groups.fork_budget {self.fork_budget} cannot pay for one group: a group of"
                f" {self.group_size} with scoring {self.scoring} opens {per_group} forks; raise"
                " fork_budget or lower group_size"
            )
        return self

    def grouping(self) -> StepGrouping:
        return StepGrouping(self.group_size, self.max_depth, self.fork_budget, self.scoring, self.branch_depth)


@dataclass
class StepTask:
    """What one task played with step-level groups gave."""

    task: TaskKey
    groups: list[RolloutGroup]
    stats: StepGroupStats
    prompt_tokens: list[int] = field(default_factory=list)  # prompt length of every Generate
    error: str | None = None  # what failed, when the task stopped before its end
    # Why the base rollout ended early, when a prompt outgrew the model's context (truncated).
    context_full: str | None = None

    def metrics(self) -> dict[str, float]:
        return self.stats.as_metrics() | {"prompt_tokens_per_turn_mean": statistics.fmean(self.prompt_tokens)
                                          if self.prompt_tokens else 0.0,
                                          "prompt_tokens_per_turn_max": max(self.prompt_tokens, default=0)}


def group_records(task: TaskKey, group: StepGroup,
                  sampled: Mapping[int, tuple[GenerationGroup, policy_pb2.GenerateSample]]) -> RolloutGroup:
    """The rollout group of one step group; `sampled` gives the Generate of each action (by id)."""
    group_id = f"{task.group_id}/step{group.step}"
    records = []
    for i, action in enumerate(group.actions):
        generation, sample = sampled[id(action)]
        tokens = Trajectory()
        tokens.add_turn(generation.prompt_token_ids, sample.completion_token_ids, sample.logprobs,
                        sample.version_spans, sampling=generation.sampling)
        records.append(RolloutRecord(
            rollout_id=f"{group_id}/{i}", group_id=group_id, env=task.env, split=task.split,
            index=task.index, sample=i, status=RolloutStatus.SCORED, reward=group.rewards[i], steps=1,
            messages=[MessageRecord.from_pb(m) for m in [*group.prompt, action]],
            token_ids=tokens.token_ids, loss_mask=tokens.loss_mask, logprobs=tokens.logprobs,
            version_spans=tokens.version_spans, sampling_spans=tokens.sampling_spans, turn_finish_reasons=[finish_reason_name(sample.finish_reason)],
            step_rewards=[group.step_rewards[i]], tokens=tokens.counts, policy_version=tokens.versions))
    return RolloutGroup(task, records, step=group.step)


async def run_step_task(task: TaskKey, env: EnvPool, policy: PolicyPool, settings: AgentSettings,
                        grouping: StepGrouping, options: Mapping[str, str] | None = None) -> StepTask:
    """Play `task` with step-level groups (clients.step_groups) on one env replica, sampling with
    the policy pool; see the module docstring."""
    sampled: dict[int, tuple[GenerationGroup, policy_pb2.GenerateSample]] = {}
    actions: list[common_pb2.ChatMessage] = []  # keeps the ids in `sampled` alive
    result = StepTask(task, [], StepGroupStats())
    max_tokens = min(settings.sampling.max_tokens, settings.max_tokens)

    async def propose(prompt: Sequence[common_pb2.ChatMessage], tools: Sequence[common_pb2.ToolSpec],
                      n: int) -> list[common_pb2.ChatMessage]:
        try:
            generation = await generate(policy, settings, prompt, tools, n=n, max_tokens=max_tokens)
        except InvalidArgument as error:
            if error.reason == Reason.PROMPT_TOO_LONG:
                result.context_full = error.message
                raise EpisodeOver(error.message) from error
            raise
        result.prompt_tokens.append(len(generation.prompt_token_ids))
        made = []
        for sample in generation.samples:
            action = common_pb2.ChatMessage(role=common_pb2.ROLE_ASSISTANT, content=sample.content,
                                            tool_calls=sample.tool_calls)
            sampled[id(action)] = (generation, sample)
            made.append(action)
        actions.extend(made)
        return made

    def on_group(group: StepGroup) -> None:
        result.groups.append(group_records(task, group, sampled))

    try:
        async with env.lease() as replica:
            try:
                await run_step_groups(replica.client, task.env, task.split, task.index, propose, grouping,
                                      options=options, deadlines=settings.deadlines, on_group=on_group,
                                      stats=result.stats)
            except Unavailable as error:
                env.mark_down(replica, error)
                raise
    except FATAL_ERRORS:
        raise
    except InvalidArgument as error:
        if error.reason in TASK_REASONS or error.reason == Reason.INVALID_REQUEST:
            raise TaskRejected(f"environment refused task {task.group_id}: {error.message}") from error
        result.error = f"{error.code.name} {error.reason}: {error.message}"
    except BranchFailed as error:
        result.error = str(error)
    except SciprotoError as error:
        if error.reason in TASK_REASONS:
            raise TaskRejected(f"environment refused task {task.group_id}: {error.message}") from error
        result.error = f"{error.code.name} {error.reason}: {error.message}"
    if result.error is not None:
        log.warning("%s stopped after %d step groups: %s", task.group_id, len(result.groups), result.error)
    return result


__all__ = ["StepGroupSettings", "StepTask", "group_records", "run_step_task"]
