"""Curriculum files: the tasks of one split worth training on.

`sciproto eval --samples K --write-curriculum FILE` writes one from K samples per task (by default
the tasks whose outcomes were mixed, 0 < pass rate < 1: the only groups that give GRPO a signal);
`sciproto train` cycles over its tasks instead of the whole split when the config names it
(`rollout.curriculum: FILE`).

The file is JSON (schema `sciproto.curriculum/1`):

    {"schema": "sciproto.curriculum/1", "env": "gsm8k", "split": "short_train",
     "indices": [3, 7, ...],                 # the tasks, in training order
     "pass_rates": {"3": 0.25, "7": 0.5},    # the measured pass rate of each listed task
     "samples": 8, "min_pass_rate": ..., "max_pass_rate": ..., "source": {...}}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

SCHEMA = "sciproto.curriculum/1"


class CurriculumError(ValueError):
    """A curriculum file that cannot be used; the message says what to fix."""


class Curriculum(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_: Literal["sciproto.curriculum/1"] = Field(SCHEMA, alias="schema")
    env: str
    split: str
    indices: list[int] = Field(description="Task indices of the split, in the order training cycles over them")
    pass_rates: dict[str, float] = Field(default_factory=dict, description="Measured pass rate per listed index")
    samples: int | None = Field(None, description="Samples per task the pass rates were measured with")
    min_pass_rate: float | None = Field(None, description="Tasks kept had a pass rate above this (exclusive)")
    max_pass_rate: float | None = Field(None, description="... and below this (exclusive)")
    source: dict[str, Any] = Field(default_factory=dict, description="What measured it: policy, checkpoint, time")

    @model_validator(mode="after")
    def _valid_indices(self) -> Curriculum:
        if any(index < 0 for index in self.indices):
            raise ValueError("indices must be >= 0")
        if len(set(self.indices)) != len(self.indices):
            raise ValueError("indices must not repeat")
        return self

    @property
    def tasks(self) -> str:
        return f"{self.env}:{self.split}"

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.model_dump_json(by_alias=True, indent=2) + "\n")
        return path


def read_curriculum(path: str | Path) -> Curriculum:
    """The curriculum in `path`; CurriculumError when it is missing, malformed or empty."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CurriculumError(f"curriculum file {path} does not exist; write one with"
                              " `sciproto eval --samples K --write-curriculum FILE`") from None
    except json.JSONDecodeError as error:
        raise CurriculumError(f"curriculum file {path} is not JSON: {error}") from None
    try:
        curriculum = Curriculum.model_validate(data)
    except ValidationError as error:
        raise CurriculumError(f"curriculum file {path} is not a {SCHEMA} file: {error}") from None
    if not curriculum.indices:
        raise CurriculumError(f"curriculum file {path} lists no tasks: nothing to train on (widen the"
                              " pass-rate window or sample more per task)")
    return curriculum


__all__ = ["SCHEMA", "Curriculum", "CurriculumError", "read_curriculum"]
