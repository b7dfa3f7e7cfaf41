"""Step-level groups: alternatives of one step sampled from the same state, by forking the episode.

    grouping = StepGrouping(group_size=4, max_depth=8, fork_budget=32)
    result = await run_step_groups(env, "notebook", "train", 3, propose, grouping,
                                   options={"observation": "state"})
    result.groups[0].prompt, result.groups[0].actions, result.groups[0].advantages()
    result.stats.forks_opened == result.stats.forks_closed

At each step of a base rollout (up to `max_depth` steps) the episode is forked `group_size` times;
`propose(prompt, tools, n)` gives one action per fork (the group, all from one prompt: the shared
state), each fork takes its action, and each branch is scored by its step reward. The base
continues from the best branch (the first of the best on a tie); every other fork, and the
episode it was forked from, is closed at once. When the fork budget of the task cannot pay for a
group of two, the base goes on with one action per step and no group. Every fork is closed by the
time this returns or raises.

The client keeps the conversation: with the notebook's `observation: state` the prompt of a turn
is the latest observations alone (they replace the conversation); otherwise actions and
observations are appended.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from clients.env_client import EnvClient
from sciproto.pb import common_pb2

# propose(prompt, tools, n) -> n assistant actions sampled from the same prompt
Propose = Callable[[Sequence[common_pb2.ChatMessage], Sequence[common_pb2.ToolSpec], int],
                   Awaitable[list[common_pb2.ChatMessage]]]


@dataclass(frozen=True)
class StepGrouping:
    """Bounds of step-level grouping (rollout.grouping: step)."""

    group_size: int = 4  # forks per group, one action each
    max_depth: int = 8  # steps of the base rollout, grouped or not
    fork_budget: int = 32  # forks one task may open in all

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ValueError(f"group_size must be at least 2 (a group of one has no advantage), got {self.group_size}")
        if self.max_depth < 1 or self.fork_budget < 0:
            raise ValueError(f"max_depth must be >= 1 and fork_budget >= 0, got {self.max_depth}, {self.fork_budget}")


@dataclass
class StepGroup:
    """The alternatives of one step: one prompt, n actions, their step rewards."""

    step: int  # steps the episode had applied before this group's actions
    prompt: list[common_pb2.ChatMessage]
    actions: list[common_pb2.ChatMessage]
    rewards: list[float]
    chosen: int  # the branch the base continued from

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


async def run_step_groups(env: EnvClient, env_name: str, split: str, index: int, propose: Propose,
                          grouping: StepGrouping, *, options: Mapping[str, str] | None = None
                          ) -> StepGroupResult:
    """Play one task with step-level groups (see the module's docstring)."""
    state_view = (options or {}).get("observation") == "state"
    stats, groups = StepGroupStats(), []
    reset = await env.reset(env_name, split=split, index=index, options=options)
    base, tools = reset.episode_id, list(reset.tools)
    conversation = list(reset.observations)
    open_forks: set[str] = set()  # forks not closed yet, the base among them once it is one

    async def close(episode_id: str) -> None:
        closed = (await env.close(episode_id)).closed
        if episode_id in open_forks:
            open_forks.discard(episode_id)
            stats.forks_closed += closed

    finished = False
    try:
        for depth in range(grouping.max_depth):
            n = min(grouping.group_size, grouping.fork_budget - stats.forks_opened)
            if n < 2:  # no budget for a group: one action on the base
                [action] = await propose(conversation, tools, 1)
                step = await env.step(base, action)
                stats.steps += 1
            else:
                forks = []
                for _ in range(n):
                    fork = await env.fork(base)
                    open_forks.add(fork.episode_id)
                    stats.forks_opened += 1
                    forks.append(fork.episode_id)
                actions = await propose(conversation, tools, n)
                if len(actions) != n:
                    raise ValueError(f"propose returned {len(actions)} actions for a group of {n}")
                answers = await asyncio.gather(*(env.step(fork, action) for fork, action in zip(forks, actions)))
                stats.steps += n
                rewards = [answer.reward.value for answer in answers]
                chosen = max(range(n), key=lambda i: (rewards[i], -i))
                groups.append(StepGroup(depth, list(conversation), list(actions), rewards, chosen))
                stats.groups += 1
                stats.reward_stds.append(statistics.pstdev(rewards))
                old_base, base = base, forks[chosen]
                for other in [old_base, *(fork for i, fork in enumerate(forks) if i != chosen)]:
                    await close(other)
                action, step = actions[chosen], answers[chosen]
            conversation = list(step.observations) if state_view else [*conversation, action, *step.observations]
            if step.terminated or step.truncated:
                finished = True
                break
    finally:
        for episode_id in {base, *open_forks}:
            await close(episode_id)
    return StepGroupResult(groups, stats, finished)
