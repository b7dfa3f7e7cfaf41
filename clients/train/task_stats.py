"""Per-task outcome statistics of a training run, and the rule that sets tasks aside.

As each group finishes (`GroupSink.send`), its task's record counts the group, its samples, the
samples that scored the full reward (`solved`, reward >= 1) and those above their group's mean
reward (`above`, the ones GRPO pushes up), and keeps the last few groups' outcomes:

| outcome    | the group's scored samples                               |
|------------|----------------------------------------------------------|
| `mixed`    | rewards differ: the group teaches                         |
| `solved`   | every one the full reward (1)                             |
| `unsolved` | every one reward 0 (or below)                             |
| `equal`    | all the same other reward                                 |
| `unscored` | fewer than two scored: nothing known                      |

A task whose last `rollout.task_filter.window` groups were all `solved`, `unsolved` or `equal`
(no signal: the learner refuses such groups) is *set aside*: the task stream passes over it,
except with probability `revisit_prob`, when a set-aside task is generated again (a policy that
changed may now get it partly right; a `mixed` group brings it back). When a whole cycle of tasks
is set aside the stream revisits one rather than wait (`TaskStream`), and says once that the split
has run out: every task is solved or out of reach for the policy as it is.

Which set-aside task a revisit generates (`revisit: promising`, the default) is the one whose
record promises the most signal, not in flight already. A GRPO group teaches when its rewards
differ; for a task that a sample solves with probability p, the chance that a group of n does is

    P(mixed) = 1 - p^n - (1 - p)^n,   with p estimated as (s + 1) / (m + 2)

(Laplace's rule), where m and s are the task's scored and solved samples with each group counted
half as much as the next one (`RECENCY`: the policy that sampled older groups is gone), so
m <= 2n. P(mixed) rises and falls with p (1 - p) whatever n is, so the stream ranks by
`promise = p (1 - p)`. A task solved 3 times of 6 and then 6 of 6 outranks one solved 6 of 6 at
its only visit; after two more groups all right it no longer does. In a 60-minute tool-use run
(911 groups, 661 of them a task's second or later) the fifth of those later groups whose task had
the highest promise came back mixed 46% of the time, against 15% over all of them. Counting every
sample alike instead kept a task mixed long ago on top through 22 groups all right in 10 minutes.
`revisit: in_turn` generates the set-aside task whose turn it is, as before. `revisits_mixed`
counts the revisits whose group came back mixed.

The statistics are persisted in the run directory (`sciproto.rundir.TASK_STATS_FILE`): a
snapshot after every optimizer step the client hears of and at the run's end, keeping those a
checkpoint may need (steps at `learner.checkpoint_every`, at or after the latest complete
checkpoint, and the newest). A resumed run restores the snapshot of its checkpoint's step (the
newest at or before it). A fresh run with a curriculum file is seeded from its pass rates: each
listed task counts the measured samples as one group.
"""

from __future__ import annotations

import json
import os
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from clients.curriculum import Curriculum
from clients.train.resume import trained_steps
from sciproto.client.rollouts import RolloutGroup, RolloutStatus, TaskKey
from sciproto.rundir import TASK_STATS_FILE, checkpoint_step, latest_checkpoint

SCHEMA = "sciproto.task_stats/1"
NO_SIGNAL = frozenset({"solved", "unsolved", "equal"})
RECENT_KEPT = 4  # group outcomes kept per task (at least the filter's window)
RECENCY = 0.5  # the weight of a task's earlier samples each time a group is added (promise)


class TaskFilter(BaseModel):
    """rollout.task_filter: which tasks the rollout client passes over."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        True,
        description=(
            "Set aside tasks whose last `window` groups all gave no signal (every sample solved, or none):"
            " the learner would refuse their groups, so generating them is wasted"
        ),
    )
    window: int = Field(2, ge=1, description="Recent groups of a task judged: all without signal sets it aside")
    revisit_prob: float = Field(
        0.1,
        ge=0.0,
        le=1.0,
        description="Probability a set-aside task's turn revisits one (the policy may have changed)",
    )
    revisit: Literal["promising", "in_turn"] = Field(
        "promising",
        description=(
            "Which set-aside task a revisit generates: `promising`, the one most likely to give a group with"
            " signal (p (1 - p) of its solved rate, not in flight); `in_turn`, the one whose turn it is"
        ),
    )


def group_outcome(group: RolloutGroup) -> tuple[str, int, int, int]:
    """(outcome, scored samples, solved, above the group's mean) of a finished group."""
    rewards = list({(r.sample, r.episode or r.rollout_id): r.reward for r in group.rollouts
                    if r.status is RolloutStatus.SCORED}.values())
    if len(rewards) < 2:
        return "unscored", len(rewards), sum(r >= 1.0 for r in rewards), 0
    solved = sum(r >= 1.0 for r in rewards)
    mean = sum(rewards) / len(rewards)
    above = sum(r > mean for r in rewards)
    if max(rewards) != min(rewards):
        return "mixed", len(rewards), solved, above
    outcome = "solved" if rewards[0] >= 1.0 else "unsolved" if rewards[0] <= 0.0 else "equal"
    return outcome, len(rewards), solved, above


@dataclass
class TaskRecord:
    """One task's outcomes so far."""

    groups: int = 0
    samples: int = 0  # scored samples
    solved: int = 0  # scored the full reward
    above: int = 0  # above their group's mean reward
    recent: deque[str] = field(default_factory=lambda: deque(maxlen=RECENT_KEPT))
    # Scored and solved samples, each group weighing RECENCY times the next one (promise).
    weighted_samples: float = 0.0
    weighted_solved: float = 0.0

    def add(self, outcome: str, samples: int, solved: int, above: int) -> None:
        self.groups += 1
        self.samples += samples
        self.solved += solved
        self.above += above
        self.recent.append(outcome)
        self.weighted_samples = RECENCY * self.weighted_samples + samples
        self.weighted_solved = RECENCY * self.weighted_solved + solved

    def no_signal(self, window: int) -> str | None:
        """'solved' / 'unsolved' / 'equal' when each of the last `window` groups had no signal
        (the latest's outcome names it); None otherwise."""
        last = list(self.recent)[-window:]
        if len(last) < window or not all(o in NO_SIGNAL for o in last):
            return None
        return last[-1]

    def promise(self) -> float:
        """p (1 - p), p = (s + 1) / (m + 2) of the weighted counts: ranks the chance that a group
        gives signal."""
        m, s = self.weighted_samples, self.weighted_solved
        # (s + 1) (m - s + 1) / (m + 2)^2: the same value for p and 1 - p
        return (s + 1) * (m - s + 1) / (m + 2) ** 2

    def to_json(self) -> dict[str, Any]:
        return {"groups": self.groups, "samples": self.samples, "solved": self.solved, "above": self.above,
                "recent": list(self.recent), "weighted_samples": self.weighted_samples,
                "weighted_solved": self.weighted_solved}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TaskRecord:
        record = cls(int(data["groups"]), int(data["samples"]), int(data["solved"]), int(data["above"]))
        record.recent.extend(data["recent"])
        # A snapshot written before the weighted counts: every sample alike.
        record.weighted_samples = float(data.get("weighted_samples", record.samples))
        record.weighted_solved = float(data.get("weighted_solved", record.solved))
        return record


@dataclass
class TaskStats:
    """Every task's record, and how the task stream used them."""

    settings: TaskFilter = field(default_factory=TaskFilter)
    tasks: dict[str, TaskRecord] = field(default_factory=dict)  # by TaskKey.group_id
    passed_over: int = 0  # turns of a set-aside task skipped
    revisited: int = 0  # turns of a set-aside task generated anyway
    revisited_all_set_aside: int = 0  # of those, the turns that came after a whole cycle set aside
    revisits_mixed: int = 0  # revisits whose group came back mixed
    # Tasks handed out and not recorded yet (a revisit does not pick one of them), and of those
    # the revisits; neither is persisted: a resumed run has nothing in flight.
    generating: set[str] = field(init=False, default_factory=set)
    revisiting: set[str] = field(init=False, default_factory=set)
    # The tasks set aside now, and why: kept as each group is recorded, so that counting them
    # after every group does not judge every task again.
    aside: dict[str, str] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self._judge_all()

    def _judge(self, key: str, record: TaskRecord) -> None:
        why = record.no_signal(self.settings.window) if self.settings.enabled else None
        if why is None:
            self.aside.pop(key, None)
        else:
            self.aside[key] = why

    def _judge_all(self) -> None:
        self.aside = {}
        for key, record in self.tasks.items():
            self._judge(key, record)

    def record(self, group: RolloutGroup) -> None:
        key = group.task.group_id
        record = self.tasks.setdefault(key, TaskRecord())
        outcome = group_outcome(group)
        record.add(*outcome)
        self._judge(key, record)
        self.generating.discard(key)
        if key in self.revisiting:
            self.revisiting.discard(key)
            self.revisits_mixed += outcome[0] == "mixed"

    def handed_out(self, task: TaskKey, revisit: bool) -> None:
        """`task` goes to be generated (a revisit of a set-aside task, or not)."""
        self.generating.add(task.group_id)
        if revisit:
            self.revisited += 1
            self.revisiting.add(task.group_id)

    def revisit_instead_of(self, task: TaskKey, within: frozenset[str] | None = None) -> TaskKey:
        """The set-aside task a revisit at `task`'s turn generates: `task` itself with `revisit:
        in_turn`; otherwise the set-aside task (of `within`, when given: a curriculum's) of the
        highest promise not in flight (`task` on a tie, or when every one is in flight)."""
        if self.settings.revisit == "in_turn":
            return task
        best_key, best = task.group_id, -1.0
        if best_key not in self.generating and best_key in self.tasks:
            best = self.tasks[best_key].promise()
        for key in self.aside:
            if (key not in self.generating and (within is None or key in within)
                    and (promise := self.tasks[key].promise()) > best):
                best_key, best = key, promise
        if best_key == task.group_id:
            return task
        env, split, index = best_key.rsplit("/", 2)
        return TaskKey(env, split, int(index))

    def set_aside(self, task: TaskKey) -> str | None:
        """Why `task` is set aside ('solved', 'unsolved', 'equal'), or None when it is not."""
        return self.aside.get(task.group_id)

    def summary(self) -> dict[str, int]:
        """The counts summary.json and the live line show."""
        reasons = list(self.aside.values())
        return {
            "tasks": len(self.tasks),
            "groups": sum(r.groups for r in self.tasks.values()),
            "set_aside": len(reasons),
            "set_aside_solved": reasons.count("solved"),
            "set_aside_unsolved": reasons.count("unsolved"),
            "passed_over": self.passed_over,
            "revisited": self.revisited,
            "revisited_all_set_aside": self.revisited_all_set_aside,
            "revisits_mixed": self.revisits_mixed,
        }

    def snapshot(self) -> dict[str, Any]:
        return {"tasks": {task: r.to_json() for task, r in self.tasks.items()},
                "passed_over": self.passed_over, "revisited": self.revisited,
                "revisited_all_set_aside": self.revisited_all_set_aside, "revisits_mixed": self.revisits_mixed}

    def restore(self, snapshot: dict[str, Any]) -> None:
        self.tasks = {task: TaskRecord.from_json(r) for task, r in snapshot["tasks"].items()}
        self.passed_over = int(snapshot.get("passed_over", 0))
        self.revisited = int(snapshot.get("revisited", 0))
        self.revisited_all_set_aside = int(snapshot.get("revisited_all_set_aside", 0))
        self.revisits_mixed = int(snapshot.get("revisits_mixed", 0))
        self._judge_all()

    def seed(self, curriculum: Curriculum) -> None:
        """A fresh run's records from a curriculum's measured pass rates (one group per task)."""
        samples = curriculum.samples or 0
        for index, rate in curriculum.pass_rates.items():
            solved = round(rate * samples)
            outcome = "solved" if rate >= 1.0 else "unsolved" if rate <= 0.0 else "mixed"
            key = TaskKey(curriculum.env, curriculum.split, int(index)).group_id
            record = self.tasks.setdefault(key, TaskRecord())
            record.add(outcome, samples, solved, 0)
            self._judge(key, record)


def _read(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / TASK_STATS_FILE
    if not path.is_file():
        return []
    return list(json.loads(path.read_text(encoding="utf-8")).get("snapshots", []))


class TaskStatsFile:
    """The run directory's snapshots of the statistics, one per optimizer step the client hears of.

    The snapshots kept are held here, each serialized once, so a step serializes only its own
    and reads nothing back: the file is read once, when this opens it (a resumed run's snapshots)."""

    def __init__(self, run_dir: Path, checkpoint_every: int) -> None:
        self.run_dir = run_dir
        self.checkpoint_every = checkpoint_every
        self.kept = {int(s["step"]): json.dumps(s) for s in _read(run_dir)}  # step -> its snapshot's JSON

    def save(self, stats: TaskStats, step: int) -> None:
        """Write the snapshot of optimizer step `step` (replacing one of the same step), keeping the
        snapshots a resume may still need (the newest at or before the latest complete checkpoint,
        and later ones at checkpoint steps); atomically (a temporary file renamed into place)."""
        floor = trained_steps(self.run_dir)  # the latest complete checkpoint's step
        earlier = [s for s in self.kept if s != step]
        resumable = max((s for s in earlier if s <= floor), default=None)
        self.kept = {s: self.kept[s] for s in sorted(earlier) if s == resumable
                     or (s > floor and self.checkpoint_every and s % self.checkpoint_every == 0)}
        self.kept[step] = json.dumps({"step": step, **stats.snapshot()})
        snapshots = ", ".join(self.kept[s] for s in sorted(self.kept))
        path = self.run_dir / TASK_STATS_FILE
        staging = path.with_name(path.name + ".tmp")
        staging.write_text(f'{{"schema": {json.dumps(SCHEMA)}, "snapshots": [{snapshots}]}}\n', encoding="utf-8")
        os.replace(staging, path)


def restore_task_stats(stats: TaskStats, run_dir: Path) -> int | None:
    """Restore the snapshot of the latest complete checkpoint's step (the newest at or before it);
    the step restored, or None when there is no checkpoint or no snapshot for it."""
    latest = latest_checkpoint(run_dir)
    if latest is None:
        return None
    step = checkpoint_step(latest) or 0
    usable = [s for s in _read(run_dir) if s["step"] <= step]
    if not usable:
        return None
    chosen = max(usable, key=lambda s: s["step"])
    stats.restore(chosen)
    return int(chosen["step"])


__all__ = ["SCHEMA", "TaskFilter", "TaskRecord", "TaskStats", "TaskStatsFile", "group_outcome",
           "restore_task_stats"]
