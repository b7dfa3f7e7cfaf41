"""Closed sessions as rollout records (`sciproto.rollout/1`, the lines `sciproto collect` writes
and training reads), and groups of them by label.

A session of one segment is one record: its calls' tokens in order, prompt tokens masked out,
sampled tokens with their logprobs and version spans. A session of several segments (its agent
rewrote its context) gives one record per segment, each a sequence of its own with the session's
reward: never one sequence glued from prompts that did not extend each other. The segments are
still one episode, one sample of the group: they share the sample number and `episode` (the
sample's rollout id), so the learner counts the session's reward once in its group's statistics and trains
each segment's tokens with that sample's advantage. Segment 0 has the rollout id of the sample,
segment k > 0 that id + "/segment{k}".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gateway.sessions import CallRecord, Session
from sciproto.client.rollouts import (
    MessageRecord,
    RolloutRecord,
    RolloutStatus,
    TaskKey,
    Trajectory,
    finish_reason_name,
)

__all__ = ["Outcome", "failed_record", "session_records", "task_for_label"]

_TASK_LABEL = re.compile(r"^(?P<env>[^/]+)/(?P<split>[^/]+)/(?P<index>\d+)(?:#.*)?$")


@dataclass(frozen=True)
class Outcome:
    """What the caller says about a finished session."""

    group: str
    reward: float = 0.0
    status: RolloutStatus = RolloutStatus.SCORED
    error: str | None = None
    task: dict[str, str] | None = None


def task_for_label(label: str) -> TaskKey:
    """"env/split/index" names a task of an environment, and so does "env/split/index#tag" (another
    group of the same task: the tag keeps groups apart); any other label is the task
    ("gateway", label, 0)."""
    match = _TASK_LABEL.match(label)
    if match:
        return TaskKey(match["env"], match["split"], int(match["index"]))
    return TaskKey("gateway", label, 0)


def session_records(session: Session, outcome: Outcome, first_sample: int) -> list[RolloutRecord]:
    """The records of a closed session, sample `first_sample` of its group."""
    task = task_for_label(outcome.group)
    segments: dict[int, list[CallRecord]] = {}
    for call in session.calls:
        segments.setdefault(call.segment, []).append(call)
    records = []
    several = len(segments) > 1
    for calls in segments.values():
        trajectory = Trajectory()
        for call in calls:
            sample = call.choices[call.chosen].sample
            trajectory.add_turn(call.prompt_token_ids, sample.completion_token_ids, sample.logprobs,
                                sample.version_spans, sampling=call.sampling)
        last = calls[-1]
        reply = last.choices[last.chosen]
        messages = [MessageRecord.from_pb(m) for m in last.messages]
        messages.append(MessageRecord(role="assistant", content=reply.content, tool_calls=[
            {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in reply.tool_calls]))
        segment = calls[0].segment
        rollout_id = task.rollout_id(first_sample) + (f"/segment{segment}" if segment else "")
        records.append(RolloutRecord(
            rollout_id=rollout_id, group_id=task.group_id, env=task.env, split=task.split,
            index=task.index, sample=first_sample, episode=task.rollout_id(first_sample) if several else "",
            task={**(outcome.task or {}), "session": session.id, "segment": str(calls[0].segment),
                  "segments": str(session.segments)},
            status=outcome.status, reward=outcome.reward if outcome.status is RolloutStatus.SCORED else 0.0,
            error=outcome.error, terminated=True, steps=len(calls), messages=messages,
            token_ids=trajectory.token_ids, loss_mask=trajectory.loss_mask, logprobs=trajectory.logprobs,
            version_spans=trajectory.version_spans, sampling_spans=trajectory.sampling_spans,
            turn_finish_reasons=[finish_reason_name(c.choices[c.chosen].sample.finish_reason) for c in calls],
            tokens=trajectory.counts, policy_version=trajectory.versions))
    return records


def failed_record(session_id: str, outcome: Outcome, sample: int) -> RolloutRecord:
    """The record of a session that failed before its first call: INFRA_ERROR, no tokens, so that
    its group still accounts for it."""
    task = task_for_label(outcome.group)
    return RolloutRecord(rollout_id=task.rollout_id(sample), group_id=task.group_id, env=task.env, split=task.split,
                         index=task.index, sample=sample, task={**(outcome.task or {}), "session": session_id},
                         status=RolloutStatus.INFRA_ERROR, error=outcome.error or "the session made no call")
