"""Where a rerun of `sciproto train` picks up: which run directory, and which groups its learner
already trained.

A run directory `<dir>/<name>` holds the learner's checkpoints under `checkpoints/step_N/`; a
checkpoint counts once its `learner_state.json` exists (the learner writes that file last;
`sciproto.rundir.latest_checkpoint`), and that file lists the ids of every group trained up to it. Group ids are
`<env>/<split>/<index>#<epoch>` (a step group adds `/step<k>`: one task epoch, many groups): a resumed run starts each task's epoch after the last one its
learner trained, so it generates only groups the learner has never seen (none is refused as a
duplicate). This module reads files only; it imports neither torch nor the learner.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from sciproto.client.rollouts import TaskKey
from sciproto.rundir import checkpoint_step, latest_checkpoint, read_learner_state

# A step group (rollout.grouping: step) adds its step: `<env>/<split>/<index>#<epoch>/step<k>`.
_GROUP_ID = re.compile(r"(?P<env>[^/]+)/(?P<split>[^/]+)/(?P<index>\d+)#(?P<epoch>\d+)(?:/step\d+)?")


def trained_steps(run_dir: Path) -> int:
    """The optimizer step of the latest complete checkpoint (0 without one)."""
    checkpoint = latest_checkpoint(run_dir)
    return (checkpoint_step(checkpoint) or 0) if checkpoint else 0


def choose_run_dir(parent: Path, name: str, resume: bool) -> Path:
    """With `resume`, the latest directory of this name that holds a checkpoint (`<name>`, or its
    highest-numbered `<name>-N`); otherwise, or when none does, `<name>` if it is free, else the
    first free `<name>-N`."""
    base = parent / name
    siblings = sorted(
        (int(p.name.rsplit("-", 1)[1]), p)
        for p in parent.glob(f"{glob_escape(name)}-*")
        if p.name.rsplit("-", 1)[1].isdigit()
    )
    if resume:
        for candidate in reversed([base, *(p for _, p in siblings)]):
            if latest_checkpoint(candidate) is not None:
                return candidate
    if not base.exists():
        return base
    for number in itertools.count(2):
        candidate = parent / f"{name}-{number}"
        if not candidate.exists():
            return candidate
    raise AssertionError("unreachable")


def glob_escape(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)


@dataclass
class ResumePoint:
    """Where the task iterator of a resumed run starts: the first task number to admit and, per
    task, the next epoch (so each group id it makes is new to the learner)."""

    start: int = 0
    epochs: dict[TaskKey, int] = field(default_factory=dict)
    trained: int = 0  # task epochs of this env and split the learner trained (some group of) before


def trained_group_ids(run_dir: Path) -> list[str]:
    """The group ids the latest checkpoint's learner trained (none without a checkpoint)."""
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        return []
    return list(read_learner_state(checkpoint).get("trained_group_ids", []))


def resume_point(group_ids: Iterable[str], env: str, split: str, size: int | None) -> ResumePoint:
    """Continue after `group_ids` (trained before): each task's epoch after its last trained one;
    the cycle over a bounded split after as many tasks as were trained, an unbounded split after
    its highest trained index."""
    point = ResumePoint()
    highest = -1
    seen: set[tuple[TaskKey, int]] = set()  # (task, epoch): the step groups of one count once
    for group_id in group_ids:
        match = _GROUP_ID.fullmatch(group_id)
        if not match or match["env"] != env or match["split"] != split:
            continue
        task, epoch = TaskKey(env, split, int(match["index"])), int(match["epoch"])
        if (task, epoch) in seen:
            continue
        seen.add((task, epoch))
        point.epochs[task] = max(point.epochs.get(task, 0), epoch + 1)
        point.trained += 1
        highest = max(highest, task.index)
    point.start = point.trained if size is not None else highest + 1
    return point


__all__ = ["ResumePoint", "choose_run_dir", "latest_checkpoint", "resume_point", "trained_group_ids", "trained_steps"]
