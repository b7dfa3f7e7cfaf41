"""Phases of `sciproto train`: supervised fine-tuning on demonstrations, then GRPO.

    phases:
      - objective: sft
        demonstrations: runs/demos/gsm8k-short_train.jsonl   # `sciproto demonstrate` wrote it
        steps: 30                                            # or epochs: 2
      - objective: grpo                                      # then rollouts, as without phases

An `sft` phase sends each demonstration (one rollout line: one group of one sample) to the learner
as a group with objective SFT (learner/sft.py), `learner.batch_groups` per optimizer step, cycling
over the file: `steps` x batch_groups groups, or `epochs` passes rounded up to whole steps. The next
phase starts once the learner has settled every group of the phase (its last step has run and its
weights are pushed), so the first GRPO rollouts come from the fine-tuned policy. Without a `grpo`
phase the run ends after the last `sft` one. `budget.max_steps` counts the steps of every phase.

A demonstration's group id is `sft<phase>:<env>/<split>/<index>#<pass>`: a resumed run skips the
groups its learner trained before (their ids are in the checkpoint) and sends the rest, then goes
on with GRPO from where it stood.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sciproto.client.rollouts import RolloutRecord, RolloutStatus, read_rollouts
from sciproto.config import ConfigError

__all__ = ["Phase", "SFTGroup", "check_phases", "sft_groups"]


class Phase(BaseModel):
    """One phase of a training run."""

    model_config = ConfigDict(extra="forbid")

    objective: Literal["sft", "grpo"]
    demonstrations: Path | None = Field(None, description="sft: a rollout file of demonstrations (sciproto demonstrate)")
    steps: int | None = Field(None, ge=1, description="sft: optimizer steps of this phase")
    epochs: float | None = Field(None, gt=0, description="sft: passes over the demonstrations (rounded up to steps)")

    @model_validator(mode="after")
    def _sft_needs_its_data(self) -> Phase:
        if self.objective == "sft":
            if self.demonstrations is None:
                raise ValueError("an sft phase needs demonstrations: a rollout file `sciproto demonstrate` wrote")
            if (self.steps is None) == (self.epochs is None):
                raise ValueError("an sft phase needs exactly one of steps and epochs")
        elif self.demonstrations is not None or self.steps is not None or self.epochs is not None:
            raise ValueError("a grpo phase takes no demonstrations, steps or epochs: it runs until the budget")
        return self


def check_phases(phases: Sequence[Phase]) -> None:
    """sft phases first, then at most one grpo phase, last."""
    objectives = [phase.objective for phase in phases]
    if "grpo" in objectives and (objectives.count("grpo") > 1 or objectives[-1] != "grpo"):
        raise ValueError(f"phases {objectives}: sft phases come first, then at most one grpo phase, last")


class SFTGroup(BaseModel):
    """One demonstration as the learner's group."""

    phase: int
    group_id: str
    record: RolloutRecord


def _demonstrations(path: Path) -> list[RolloutRecord]:
    if not path.is_file():
        raise ConfigError(f"phases: demonstrations file {path} does not exist; write it with sciproto demonstrate")
    try:
        records = [r for r in read_rollouts(path)
                   if r.status is RolloutStatus.SCORED and r.detail == "full" and any(r.loss_mask)]
    except ValueError as error:
        raise ConfigError(f"phases: {error}") from None
    if not records:
        raise ConfigError(f"phases: {path} holds no scored demonstration with trainable tokens")
    return records


def sft_groups(phases: Sequence[Phase], batch_groups: int, trained: Iterable[str] = ()) -> list[SFTGroup]:
    """Every group of the sft phases, in order, without those in `trained` (a resumed run), and
    no more per phase than it has left: its steps x batch_groups less the groups trained in it.
    A demonstrations file written again since (in another order) changes which records that is,
    never how many: a finished phase stays finished."""
    done = set(trained)
    groups: list[SFTGroup] = []
    for number, phase in enumerate(phases):
        if phase.objective != "sft":
            continue
        assert phase.demonstrations is not None
        records = _demonstrations(phase.demonstrations)
        steps = phase.steps if phase.steps is not None else math.ceil(phase.epochs * len(records) / batch_groups)
        prefix = f"sft{number}:"
        left = steps * batch_groups - sum(1 for group_id in done if group_id.startswith(prefix))
        for k in range(steps * batch_groups):
            if left <= 0:
                break
            record = records[k % len(records)]
            group_id = f"{prefix}{record.group_id}#{k // len(records)}"
            if group_id not in done:
                groups.append(SFTGroup(phase=number, group_id=group_id, record=record))
                left -= 1
    return groups
