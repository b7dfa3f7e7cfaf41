"""Demonstrations from the environment itself: `sciproto demonstrate`.

A reference agent plays each task of a split through a real env server: it asks the server for
the task's reference actions (the `Reference` RPC; GSM8K answers one `calculator` call per
`<<expression=result>>` annotation of the worked solution, then `submit_answer`), Steps them in
order after Reset, and Verifies the episode. Each action is written as the policy would write it:
the prompt tokens are made exactly as the policy server makes them (`sciproto.prompts`, the
first turn rendered whole, later turns extending the previous turn's ids), and the completion
tokens are the model's chat template rendering of the assistant turn (its tool-call blocks and
the end-of-turn token), so a model trained on them produces what the policy server parses back
into the same tool calls.

Only episodes the environment scores at the top (`--min-reward`, default 1.0) are kept. Each is
one line of the rollout format (`sciproto.client.rollouts`): `loss_mask` is 1 on the assistant's tokens
and 0 on the prompt and the environment's turns, `logprobs` are 0 (nothing was sampled), and
`policy_version` is empty. The file feeds `learner.sft` (a train config's `sft` phase).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sciproto.chat import GenerationRequest, chat_message, tool_spec
from sciproto.client.env import EnvClient
from sciproto.client.rollouts import (
    MessageRecord,
    RolloutRecord,
    RolloutStatus,
    TaskKey,
    Trajectory,
    drop_torn_tail,
    read_rollouts,
    status_from_pb,
)
from sciproto.models import load_model
from sciproto.pb import common_pb2
from sciproto.prompts import prompt_token_ids, render_chat

__all__ = ["DemonstrationSummary", "TurnRenderer", "collect_demonstrations", "demonstrate", "main"]


class TurnRenderer:
    """The tokens of a turn as the policy server sees and writes them, for one model."""

    def __init__(self, tokenizer: object, stop_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.stop_token_ids = stop_token_ids

    @classmethod
    def of_model(cls, spec: str) -> TurnRenderer:
        loaded = load_model(spec)
        return cls(loaded.tokenizer, loaded.stop_token_ids)

    def prompt(self, messages: Sequence[common_pb2.ChatMessage], tools: Sequence[common_pb2.ToolSpec],
               previous_token_ids: Sequence[int]) -> list[int]:
        """The prompt ids the policy server would make for this turn (as the agent sends it)."""
        request = GenerationRequest(
            messages=[chat_message(m, i) for i, m in enumerate(messages)],
            tools=[tool_spec(t, i) for i, t in enumerate(tools)],
            previous_token_ids=list(previous_token_ids) or None)
        return prompt_token_ids(self.tokenizer, request, self.stop_token_ids)  # type: ignore[arg-type]

    def completion(self, messages: Sequence[common_pb2.ChatMessage], tools: Sequence[common_pb2.ToolSpec],
                   action: common_pb2.ChatMessage) -> list[int]:
        """The ids of `action` as the model would write it after `messages`: the template's text of
        the assistant turn up to and including its end-of-turn token."""
        template_tools = [tool_spec(t, i) for i, t in enumerate(tools)]
        history = [chat_message(m, i) for i, m in enumerate(messages)]
        before = render_chat(self.tokenizer, history, template_tools, add_generation_prompt=True)  # type: ignore[arg-type]
        after = render_chat(self.tokenizer, [*history, chat_message(action, len(history))],  # type: ignore[arg-type]
                            template_tools, add_generation_prompt=False)
        if not after.startswith(before):
            raise ValueError("the chat template does not render an assistant turn after the generation prompt")
        turn = after[len(before):]
        stops = [self.tokenizer.decode([token]) for token in self.stop_token_ids]  # type: ignore[attr-defined]
        end = min((turn.find(stop) + len(stop) for stop in stops if stop and stop in turn), default=-1)
        if end < 0:
            raise ValueError("the rendered assistant turn holds no end-of-turn token")
        return self.tokenizer.encode(turn[:end], add_special_tokens=False)  # type: ignore[attr-defined]


async def demonstrate(env: EnvClient, renderer: TurnRenderer, task: TaskKey, *, timeout_s: float = 60.0,
                      max_tokens: int | None = None) -> RolloutRecord:
    """Play `task`'s reference actions through `env` and record the episode as a rollout."""
    actions = await env.reference(task.env, split=task.split, index=task.index, timeout=timeout_s)
    reset = await env.reset(task.env, split=task.split, index=task.index, timeout=timeout_s)
    transcript = list(reset.observations)
    tools = list(reset.tools)
    trajectory = Trajectory()
    step_rewards: list[float] = []
    terminated = truncated = False
    attempt = uuid.uuid4().hex  # request ids of this episode (a retry would reuse them)
    try:
        for number, action in enumerate(actions):
            action = common_pb2.ChatMessage(role=common_pb2.ROLE_ASSISTANT, content=action.content,
                                            tool_calls=action.tool_calls)
            prompt = renderer.prompt(transcript, tools, trajectory.token_ids)
            completion = renderer.completion(transcript, tools, action)
            trajectory.add_turn(prompt, completion, [0.0] * len(completion), [])
            transcript.append(action)
            step = await env.step(reset.episode_id, action, request_id=f"{attempt}/step/{number}",
                                  timeout=timeout_s)
            step_rewards.append(step.reward.value)
            transcript.extend(step.observations)
            terminated, truncated = step.terminated, step.truncated
            if terminated or truncated:
                break
        reward = (await env.verify(reset.episode_id, timeout=timeout_s)).reward
    finally:
        await env.close(reset.episode_id, timeout=timeout_s)
    status = status_from_pb(reward.status)
    error = None
    if max_tokens is not None and len(trajectory.token_ids) > max_tokens:
        error = f"the demonstration has {len(trajectory.token_ids)} tokens, more than max_tokens {max_tokens}"
    return RolloutRecord(
        rollout_id=task.rollout_id(0), group_id=task.group_id, env=task.env, split=task.split, index=task.index,
        sample=0, task=dict(reset.task_summary), status=status, reward=reward.value,
        reward_components=dict(reward.components), reward_detail=reward.detail or (error or ""),
        terminated=terminated, truncated=truncated, steps=len(step_rewards),
        messages=[MessageRecord.from_pb(m) for m in transcript], token_ids=trajectory.token_ids,
        loss_mask=trajectory.loss_mask, logprobs=trajectory.logprobs,
        turn_finish_reasons=["stop"] * len(step_rewards), step_rewards=step_rewards, tokens=trajectory.counts)


@dataclass
class DemonstrationSummary:
    tasks: int = 0
    kept: int = 0
    dropped: int = 0  # played but scored below min_reward (or too long)
    skipped: int = 0  # already in the output file
    tokens: int = 0  # trainable (assistant) tokens of the kept demonstrations

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


async def collect_demonstrations(env_target: str, model: str, env_name: str, split: str, output: Path, *,
                                 limit: int | None = None, min_reward: float = 1.0, concurrency: int = 8,
                                 max_tokens: int | None = None, timeout_s: float = 60.0) -> DemonstrationSummary:
    """Demonstrations of the first `limit` tasks of `env_name:split` (all by default), appended to
    `output`; tasks already there are skipped (a rerun resumes)."""
    renderer = TurnRenderer.of_model(model)
    drop_torn_tail(output)
    done = {record.group_id for record in read_rollouts(output)}
    summary = DemonstrationSummary()
    async with EnvClient(env_target, transport="unary", default_timeout_s=timeout_s) as env:
        info = await env.describe(timeout=timeout_s)
        sizes = {e.name: {s.name: s.size for s in e.splits} for e in info.environments}
        if split not in sizes.get(env_name, {}):
            raise ValueError(f"the env server has no split {env_name}:{split}; it serves "
                             f"{', '.join(f'{e}:{s}' for e, splits in sizes.items() for s in splits)}")
        count = min(limit, sizes[env_name][split]) if limit is not None else sizes[env_name][split]
        tasks = [TaskKey(env_name, split, index) for index in range(count)]
        summary.tasks = len(tasks)
        slots = asyncio.Semaphore(concurrency)

        async def one(task: TaskKey) -> RolloutRecord | None:
            if task.group_id in done:
                summary.skipped += 1
                return None
            async with slots:
                return await demonstrate(env, renderer, task, timeout_s=timeout_s, max_tokens=max_tokens)

        output.parent.mkdir(parents=True, exist_ok=True)
        with output.open("a", encoding="utf-8") as out:
            for finished in asyncio.as_completed([one(task) for task in tasks]):
                record = await finished
                if record is None:
                    continue
                too_long = max_tokens is not None and len(record.token_ids) > max_tokens
                if record.status is RolloutStatus.SCORED and record.reward >= min_reward and not too_long:
                    out.write(record.to_json_line())
                    out.flush()
                    summary.kept += 1
                    summary.tokens += sum(record.loss_mask)
                else:
                    summary.dropped += 1
    return summary


def main(*, env: str, model: str, tasks: str, output: Path, limit: int | None = None, min_reward: float = 1.0,
         concurrency: int = 8, max_tokens: int | None = None) -> DemonstrationSummary:
    env_name, _, split = tasks.partition(":")
    if not env_name or not split:
        raise ValueError(f"--tasks is ENV:SPLIT, e.g. gsm8k:short_train; got {tasks!r}")
    return asyncio.run(collect_demonstrations(env, model, env_name, split, output, limit=limit,
                                              min_reward=min_reward, concurrency=concurrency, max_tokens=max_tokens))
