"""Step-level groups: alternatives of one step sampled from the same state, by forking the episode.

    grouping = StepGrouping(group_size=4, max_depth=8, fork_budget=32)
    result = await run_step_groups(env, "notebook", "train", 3, propose, grouping,
                                   options={"observation": "state"})
    result.groups[0].prompt, result.groups[0].actions, result.groups[0].advantages()
    result.stats.forks_opened == result.stats.forks_closed

At each step of a base rollout (up to `max_depth` steps) the episode is forked `group_size` times;
`propose(prompt, tools, n)` gives one action per fork (the group, all from one prompt: the shared
state), each fork takes its action, and each branch is scored:

- `scoring="step_reward"`: by the reward of that step;
- `scoring="rollout"`: by its return from that step to the end: the branch's step reward plus the
  rewards of up to `branch_depth` further steps, one action each, played on a fork of the branch
  (so the branch itself stays at the group's step). Costs 2 forks per alternative.

The base continues from the best branch (the first of the best on a tie); every other fork, and
the episode it was forked from, is closed at once. When the fork budget of the task cannot pay for
a group of two, the base goes on with one action per step and no group. Every fork is closed by
the time this returns or raises, cancelled or not.

`propose` is called once per step of the base, in step order (`StepGroup.step` is that call's
number), and once per step of a scoring rollout (after its group's call). It may raise
`EpisodeOver` to end the base rollout there as truncated (e.g. the prompt outgrew the model's
context); a scoring rollout that hits it ends with the return so far.

The client keeps the conversation: with the notebook's `observation: state` the prompt of a turn
is the latest observations alone (they replace the conversation); otherwise actions and
observations are appended.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from clients.agent import finish_despite_cancellation
from sciproto.client.env import EnvClient
from sciproto.client.retries import Deadlines, call_with_deadline
from sciproto.errors import SciprotoError
from sciproto.pb import common_pb2, env_pb2

# propose(prompt, tools, n) -> n assistant actions sampled from the same prompt
Propose = Callable[[Sequence[common_pb2.ChatMessage], Sequence[common_pb2.ToolSpec], int],
                   Awaitable[list[common_pb2.ChatMessage]]]
Scoring = Literal["step_reward", "rollout"]


class BranchFailed(Exception):
    """A Step whose reward status is INFRA_ERROR: the environment failed, and the step cannot be
    scored (never read as a reward of 0)."""


class EpisodeOver(Exception):
    """Raised by `propose`: the episode cannot go on (it ends as truncated)."""


@dataclass(frozen=True)
class StepGrouping:
    """Bounds of step-level grouping (rollout.grouping: step)."""

    group_size: int = 4  # forks per group, one action each
    max_depth: int = 8  # steps of the base rollout, grouped or not
    fork_budget: int = 32  # forks one task may open in all (scoring rollouts included)
    scoring: Scoring = "step_reward"
    branch_depth: int = 4  # scoring "rollout": most steps played after the group's step

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ValueError(f"group_size must be at least 2 (a group of one has no advantage), got {self.group_size}")
        if self.max_depth < 1 or self.fork_budget < 0 or self.branch_depth < 0:
            raise ValueError(f"max_depth must be >= 1, fork_budget and branch_depth >= 0; got {self.max_depth},"
                             f" {self.fork_budget}, {self.branch_depth}")
        if self.scoring not in ("step_reward", "rollout"):
            raise ValueError(f"scoring must be 'step_reward' or 'rollout', got {self.scoring!r}")

    @property
    def forks_per_alternative(self) -> int:
        return 2 if self.scoring == "rollout" else 1


@dataclass
class StepGroup:
    """The alternatives of one step: one prompt, n actions, their scores."""

    step: int  # steps the episode had applied before this group's actions
    prompt: list[common_pb2.ChatMessage]
    actions: list[common_pb2.ChatMessage]
    rewards: list[float]  # each branch's score (its step reward, or its return with scoring "rollout")
    chosen: int  # the branch the base continued from
    step_rewards: list[float] = field(default_factory=list)  # each branch's reward of this step

    def advantages(self) -> list[float]:
        """A_i = (r_i - mean(r)) / (std(r) + 1e-6), the group's own baseline (GRPO)."""
        mean, std = statistics.fmean(self.rewards), statistics.pstdev(self.rewards)
        return [(reward - mean) / (std + 1e-6) for reward in self.rewards]


@dataclass
class StepGroupStats:
    forks_opened: int = 0
    forks_closed: int = 0
    groups: int = 0
    steps: int = 0
    reward_stds: list[float] = field(default_factory=list)  # one per group

    def as_metrics(self) -> dict[str, float]:
        return {"forks_opened": self.forks_opened, "forks_closed": self.forks_closed, "step_groups": self.groups,
                "step_group_reward_std": statistics.fmean(self.reward_stds) if self.reward_stds else 0.0}


@dataclass
class StepGroupResult:
    groups: list[StepGroup]
    stats: StepGroupStats
    finished: bool  # the base rollout terminated or was truncated (else it ran out of depth)


def _next_conversation(conversation: list[common_pb2.ChatMessage], action: common_pb2.ChatMessage,
                       step: env_pb2.StepResponse, state_view: bool) -> list[common_pb2.ChatMessage]:
    return list(step.observations) if state_view else [*conversation, action, *step.observations]


async def run_step_groups(env: EnvClient, env_name: str, split: str, index: int, propose: Propose,
                          grouping: StepGrouping, *, options: Mapping[str, str] | None = None,
                          deadlines: Deadlines | None = None,
                          on_group: Callable[[StepGroup], None] | None = None,
                          stats: StepGroupStats | None = None) -> StepGroupResult:
    """Play one task with step-level groups (see the module's docstring). Every env call is bounded
    by `deadlines` (Fork by its step deadline: a notebook fork replays the episode's cells).
    `on_group` hears of each group as it completes and `stats` (given) is kept up to date, so a
    caller keeps both when a later call fails."""
    limits = deadlines or Deadlines()
    state_view = (options or {}).get("observation") == "state"
    stats = stats if stats is not None else StepGroupStats()
    groups: list[StepGroup] = []
    open_forks: set[str] = set()  # forks not closed yet, the base among them once it is one

    async def step(episode_id: str, action: common_pb2.ChatMessage) -> env_pb2.StepResponse:
        answer = await call_with_deadline(lambda t: env.step(episode_id, action, timeout=t), limits.step_s, "Step")
        stats.steps += 1
        if answer.reward.status == common_pb2.REWARD_STATUS_INFRA_ERROR:
            raise BranchFailed(f"the environment failed on step {answer.step_count}: "
                               f"{answer.reward.detail or 'no detail'}")
        return answer

    async def fork(episode_id: str) -> str:
        forked = await call_with_deadline(lambda t: env.fork(episode_id, timeout=t), limits.step_s, "Fork")
        open_forks.add(forked.episode_id)
        stats.forks_opened += 1
        return forked.episode_id

    async def close(episode_id: str) -> None:
        closed = (await call_with_deadline(lambda t: env.close(episode_id, timeout=t), limits.close_s, "Close")).closed
        if episode_id in open_forks:
            open_forks.discard(episode_id)
            stats.forks_closed += closed

    async def play_out(branch: str, conversation: list[common_pb2.ChatMessage]) -> float:
        """The rewards of up to `branch_depth` more steps on a fork of `branch`, one action each."""
        episode, total = await fork(branch), 0.0
        try:
            for _ in range(grouping.branch_depth):
                try:
                    [action] = await propose(conversation, tools, 1)
                except EpisodeOver:
                    break
                answer = await step(episode, action)
                total += answer.reward.value
                if answer.terminated or answer.truncated:
                    break
                conversation = _next_conversation(conversation, action, answer, state_view)
        finally:
            await close(episode)
        return total

    reset = await call_with_deadline(lambda t: env.reset(env_name, split=split, index=index, options=options,
                                                         timeout=t), limits.reset_s, "Reset")
    base, tools = reset.episode_id, list(reset.tools)
    conversation = list(reset.observations)
    finished = False
    try:
        for depth in range(grouping.max_depth):
            n = min(grouping.group_size,
                    (grouping.fork_budget - stats.forks_opened) // grouping.forks_per_alternative)
            try:
                actions = await propose(conversation, tools, 1 if n < 2 else n)
            except EpisodeOver:
                finished = True
                break
            if n < 2:  # no budget for a group: one action on the base
                [action] = actions
                answer = await step(base, action)
            else:
                if len(actions) != n:
                    raise ValueError(f"propose returned {len(actions)} actions for a group of {n}")
                forks = [await fork(base) for _ in range(n)]
                answers = await asyncio.gather(*(step(f, a) for f, a in zip(forks, actions)))
                step_rewards = [answer.reward.value for answer in answers]
                rewards = list(step_rewards)
                if grouping.scoring == "rollout":
                    for i, (branch, action, answer) in enumerate(zip(forks, actions, answers)):
                        if not (answer.terminated or answer.truncated):
                            rewards[i] += await play_out(
                                branch, _next_conversation(conversation, action, answer, state_view))
                chosen = max(range(n), key=lambda i: (rewards[i], -i))
                groups.append(StepGroup(depth, list(conversation), list(actions), rewards, chosen, step_rewards))
                if on_group is not None:
                    on_group(groups[-1])
                stats.groups += 1
                stats.reward_stds.append(statistics.pstdev(rewards))
                for other in [*(f for i, f in enumerate(forks) if i != chosen), base]:
                    await close(other)
                base = forks[chosen]
                action, answer = actions[chosen], answers[chosen]
            if answer.terminated or answer.truncated:
                finished = True
                break
            conversation = _next_conversation(conversation, action, answer, state_view)
    finally:
        # Every episode still open is closed, even when this task is being cancelled (a second
        # cancellation included) or an env call failed; a Close that fails is left to the
        # server's idle TTL and does not hide the error that brought us here.
        async def close_all() -> None:
            for episode_id in sorted({base, *open_forks}):
                with contextlib.suppress(SciprotoError):
                    await close(episode_id)

        await finish_despite_cancellation(close_all())
    return StepGroupResult(groups, stats, finished)
