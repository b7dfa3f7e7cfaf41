"""Rollout records: the JSON line format shared by `sciproto collect`, the viewer and training,
and the token bookkeeping that builds one trajectory from several Generate turns.

One JSON object per line, UTF-8:

    {"schema": "sciproto.rollout/1",
     "rollout_id": "gsm8k/test/3/0",       # env/split/index/sample: unique key, used to resume
     "group_id": "gsm8k/test/3",           # the samples of one task form a group (a step group:
                                           #   "notebook/train/3/step2", one line per branch)
     "env": "gsm8k", "split": "test", "index": 3, "sample": 0,
     "episode": "",                        # non-empty: this line is one segment of that episode
                                           #   (the gateway's session that rewrote its history)
     "task": {"question": "..."},          # the env's task summary (strings)
     "status": "SCORED" | "UNSCORED" | "INFRA_ERROR",
     "reward": 1.0, "reward_components": {"correct": 1.0}, "reward_detail": "",
     "terminated": true, "truncated": false, "steps": 2,
     "messages": [{"role": "system|user|assistant|tool", "content": "...",
                   "tool_calls": [{"id": "...", "name": "...", "arguments": "{json}"}],
                   "tool_call_id": "", "name": ""}, ...],
     "token_ids": [...], "loss_mask": [...], "logprobs": [...],  # whole trajectory, aligned
     "version_spans": [[start, end, version], ...],             # indices into token_ids
     "sampling_spans": [[start, end, temperature, top_p, top_k], ...],  # what sampled those tokens
     "turn_finish_reasons": ["stop" | "length" | "abort" | "unspecified", ...],  # per policy turn
     "step_rewards": [0.0, ...],                                # each Step's reward, in order
     "tokens": {"prompt": 120, "completion": 40},
     "policy_version": {"min": 3, "max": 4},
     "seconds": 1.73, "trace_id": "32 hex chars or empty", "error": null | "what failed",
     "finished_at": "ISO 8601 UTC",
     "detail": "full" | "summary"}                               # summary: no per-token arrays

`loss_mask` is 1 for tokens the policy sampled and 0 for prompt and environment tokens;
`logprobs` is the sampling log-probability where the mask is 1 and 0 elsewhere. An INFRA_ERROR
rollout (the environment failed, or a server stayed unreachable) must never be trained on; its
reward is 0 only as a placeholder and `error` says what failed. `turn_finish_reasons` says why each
policy turn ended ("length": cut by its token limit); `step_rewards` holds the environment's reward
of each Step (`reward` is the Verify grade); `sampling_spans` the distribution each policy turn was
drawn from (sciproto/sampling.py; a greedy turn reads 1, 1, 0), which training computes log pi
under. All three are empty in files written before they existed.

Why full files are large: a line holds every token id, its loss-mask bit and its log-probability
(a float written as up to 20 characters of JSON text) for the whole trajectory, prompt included,
so a rollout of a few hundred tokens takes several kilobytes, most of it logprobs, and a training
run writes one line per sample of every group. A *summary* line (`detail: "summary"`, written by
`sciproto collect --rollouts summary` or `rollout.rollouts_file: summary` in training) keeps
everything else (ids, task, status, reward and components, messages, token counts, versions,
timings) and leaves the three arrays and `version_spans` empty: the transcript and figures stay,
the trainable tokens go. `sciproto view` reads both kinds, in one file or mixed.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from sciproto.pb import common_pb2, policy_pb2
from sciproto.sampling import Distribution

SCHEMA = "sciproto.rollout/1"
RolloutDetail = Literal["full", "summary"]


class RolloutStatus(StrEnum):
    SCORED = "SCORED"
    UNSCORED = "UNSCORED"
    INFRA_ERROR = "INFRA_ERROR"


_STATUS_FROM_PB = {
    common_pb2.REWARD_STATUS_SCORED: RolloutStatus.SCORED,
    common_pb2.REWARD_STATUS_UNSCORED: RolloutStatus.UNSCORED,
    common_pb2.REWARD_STATUS_UNSPECIFIED: RolloutStatus.UNSCORED,  # the proto says: treat as UNSCORED
    common_pb2.REWARD_STATUS_INFRA_ERROR: RolloutStatus.INFRA_ERROR,
}
_ROLE_NAMES = {
    common_pb2.ROLE_SYSTEM: "system", common_pb2.ROLE_USER: "user",
    common_pb2.ROLE_ASSISTANT: "assistant", common_pb2.ROLE_TOOL: "tool",
}

_ROLE_FROM_NAME = {name: role for role, name in _ROLE_NAMES.items()}


def status_from_pb(status: int) -> RolloutStatus:
    return _STATUS_FROM_PB[status]


FinishReasonName = Literal["stop", "length", "abort", "unspecified"]
FINISH_REASON_TO_PB: dict[str, int] = {
    "unspecified": policy_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": policy_pb2.FINISH_REASON_STOP,
    "length": policy_pb2.FINISH_REASON_LENGTH,
    "abort": policy_pb2.FINISH_REASON_ABORT,
}
_FINISH_REASON_FROM_PB = {number: name for name, number in FINISH_REASON_TO_PB.items()}


def finish_reason_name(reason: int) -> FinishReasonName:
    """A policy FinishReason as the record's name; a number this client does not know is "unspecified"."""
    return _FINISH_REASON_FROM_PB.get(reason, "unspecified")  # type: ignore[return-value]


@dataclass(frozen=True, order=True)
class TaskKey:
    """One task of an environment's dataset."""

    env: str
    split: str
    index: int

    @property
    def group_id(self) -> str:
        return f"{self.env}/{self.split}/{self.index}"

    def rollout_id(self, sample: int) -> str:
        return f"{self.group_id}/{sample}"


class ToolCallRecord(BaseModel):
    id: str = ""
    name: str
    arguments: str = Field(description="JSON object as text, verbatim as the model wrote it")


class PartRecord(BaseModel):
    """One typed part of a message's content (ChatMessage.parts): text, an image (its bytes in
    base64, as JSON holds no bytes) or a file reference."""

    type: Literal["text", "image", "file"]
    text: str = ""
    mime_type: str = ""
    data_base64: str = Field("", description="image bytes, base64 (standard alphabet, padded)")
    uri: str = Field("", description="file: where it is (workspace path or URI)")

    @classmethod
    def from_pb(cls, part: common_pb2.ContentPart) -> PartRecord:
        kind = part.WhichOneof("part")
        if kind == "image":
            return cls(type="image", mime_type=part.image.mime_type,
                       data_base64=base64.b64encode(part.image.data).decode())
        if kind == "file":
            return cls(type="file", uri=part.file.uri, mime_type=part.file.mime_type)
        return cls(type="text", text=part.text)

    def to_pb(self) -> common_pb2.ContentPart:
        if self.type == "image":
            return common_pb2.ContentPart(image=common_pb2.ImagePart(
                data=base64.b64decode(self.data_base64), mime_type=self.mime_type))
        if self.type == "file":
            return common_pb2.ContentPart(file=common_pb2.FileRef(uri=self.uri, mime_type=self.mime_type))
        return common_pb2.ContentPart(text=self.text)


class MessageRecord(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    tool_calls: list[ToolCallRecord] = Field(default_factory=list)
    tool_call_id: str = ""
    name: str = ""
    parts: list[PartRecord] = Field(default_factory=list, description="typed parts, when the message has more "
                                                                      "than text (content holds its text)")

    @classmethod
    def from_pb(cls, message: common_pb2.ChatMessage) -> MessageRecord:
        if message.role not in _ROLE_NAMES:
            raise ValueError(f"chat message has no role (got {message.role}); the server must set one")
        return cls(
            role=_ROLE_NAMES[message.role],  # type: ignore[arg-type]
            content=message.content,
            tool_calls=[ToolCallRecord(id=c.id, name=c.name, arguments=c.arguments) for c in message.tool_calls],
            tool_call_id=message.tool_call_id,
            name=message.name,
            parts=[PartRecord.from_pb(part) for part in message.parts],
        )

    def to_pb(self) -> common_pb2.ChatMessage:
        """The message as it travelled (the inverse of from_pb): a stored trajectory to Verify."""
        return common_pb2.ChatMessage(
            role=_ROLE_FROM_NAME[self.role],
            content=self.content,
            tool_calls=[common_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in self.tool_calls],
            tool_call_id=self.tool_call_id,
            name=self.name,
            parts=[part.to_pb() for part in self.parts],
        )


class TokenCounts(BaseModel):
    prompt: int = Field(0, description="Tokens the policy did not sample: prompt and environment turns")
    completion: int = Field(0, description="Tokens the policy sampled (loss_mask 1)")


class VersionRange(BaseModel):
    min: int | None = None
    max: int | None = None


class RolloutRecord(BaseModel):
    """One line of a rollout file."""

    schema_: Literal["sciproto.rollout/1"] = Field(SCHEMA, alias="schema")
    rollout_id: str
    group_id: str
    env: str
    split: str
    index: int = Field(ge=0)
    sample: int = Field(ge=0)
    episode: str = Field("", description="Records of a group with the same non-empty episode are the segments of "
                         "one episode (an agent that rewrote its history): they share `sample`, count as one sample "
                         "of the group, and each trains with that sample's advantage")
    task: dict[str, str] = Field(default_factory=dict)
    status: RolloutStatus
    reward: float = 0.0
    reward_components: dict[str, float] = Field(default_factory=dict)
    reward_detail: str = ""
    terminated: bool = False
    truncated: bool = False
    steps: int = 0
    messages: list[MessageRecord] = Field(default_factory=list)
    token_ids: list[int] = Field(default_factory=list)
    loss_mask: list[int] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    version_spans: list[tuple[int, int, int]] = Field(default_factory=list)
    sampling_spans: list[tuple[int, int, float, float, int]] = Field(
        default_factory=list, description="[start, end, temperature, top_p, top_k]: the distribution those tokens were"
        " sampled from")
    turn_finish_reasons: list[FinishReasonName] = Field(
        default_factory=list, description='Why each policy turn ended, in order; "length": cut by its token limit')
    step_rewards: list[float] = Field(default_factory=list, description="The environment's reward of each Step, in order")
    tokens: TokenCounts = Field(default_factory=TokenCounts)
    policy_version: VersionRange = Field(default_factory=VersionRange)
    seconds: float = 0.0
    trace_id: str = ""
    error: str | None = None
    finished_at: str = Field(default_factory=lambda: datetime.now(UTC).isoformat())
    detail: RolloutDetail = Field("full", description="summary: the per-token arrays were left out")

    model_config = {"populate_by_name": True}

    @model_validator(mode="after")
    def _aligned(self) -> RolloutRecord:
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.logprobs) != n:
            raise ValueError(f"rollout {self.rollout_id}: token_ids ({n}), loss_mask ({len(self.loss_mask)})"
                             f" and logprobs ({len(self.logprobs)}) must have the same length")
        if any(start < 0 or end > n or start >= end for start, end, _ in self.version_spans):
            raise ValueError(f"rollout {self.rollout_id}: version_spans must lie within token_ids [0, {n})")
        if any(start < 0 or end > n or start >= end for start, end, *_ in self.sampling_spans):
            raise ValueError(f"rollout {self.rollout_id}: sampling_spans must lie within token_ids [0, {n})")
        if self.status is RolloutStatus.INFRA_ERROR and not self.error:
            raise ValueError(f"rollout {self.rollout_id}: an INFRA_ERROR rollout must say what failed in `error`")
        return self

    def to_json_line(self, detail: RolloutDetail = "full") -> str:
        """The record as one line; `detail="summary"` leaves out the per-token arrays."""
        record = self
        if detail == "summary":
            record = self.model_copy(update={"token_ids": [], "loss_mask": [], "logprobs": [],
                                             "version_spans": [], "sampling_spans": [], "detail": "summary"})
        return record.model_dump_json(by_alias=True) + "\n"


@dataclass
class RolloutGroup:
    """The samples of one task, in sample order: the unit GRPO normalises advantages over. A step
    group (`rollout.grouping: step`) holds the alternatives of one step of the task instead: one
    prompt, one completion per sample; `step` is the steps its episode had taken before."""

    task: TaskKey
    rollouts: list[RolloutRecord]
    step: int | None = None

    @property
    def group_id(self) -> str:
        return self.task.group_id if self.step is None else f"{self.task.group_id}/step{self.step}"

    @property
    def size(self) -> int:
        """Its samples: the records of one episode's segments count once."""
        return len({(r.sample, r.episode) if r.episode else (r.sample, r.rollout_id) for r in self.rollouts})

    @property
    def complete(self) -> bool:
        """Every sample was judged or left unjudged by the environment (none failed)."""
        return all(r.status is not RolloutStatus.INFRA_ERROR for r in self.rollouts)


class TokenDriftError(ValueError):
    """A turn's prompt does not extend the trajectory so far token for token."""


@dataclass
class Trajectory:
    """Whole-trajectory tokens built turn by turn.

    Turn k's prompt must start with every token of turns < k (prompt + completion): the policy
    server extends `previous_token_ids` instead of re-tokenizing. The new prompt tokens are
    environment tokens (mask 0); the completion tokens are policy tokens (mask 1).

    With the notebook's state view (`observation: state`) a turn's prompt is the current state
    alone and does not extend the previous turn: the arrays then hold each turn's whole prompt
    and its completion one after the other. Such a record is a transcript of what each turn saw,
    not one sequence to train on (`sciproto train` trains state-view episodes with
    `rollout.grouping: step`, one sequence per turn).
    """

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    version_spans: list[tuple[int, int, int]] = field(default_factory=list)
    sampling_spans: list[tuple[int, int, float, float, int]] = field(default_factory=list)
    last_turn_tokens: int = 0  # prompt + completion of the latest turn

    def add_turn(self, prompt_ids: Sequence[int], completion_ids: Sequence[int],
                 logprobs: Sequence[float], spans: Sequence[common_pb2.VersionSpan], *,
                 extends: bool = True, sampling: Distribution | None = None) -> None:
        """Append one turn. `extends=False`: the prompt is a fresh one that does not continue the
        turns before it (the notebook's state view); all of its tokens are appended (mask 0).
        `sampling`: the distribution the completion was drawn from (None: not known)."""
        if len(logprobs) != len(completion_ids):
            raise ValueError(f"the policy returned {len(logprobs)} logprobs for {len(completion_ids)} tokens")
        known = len(self.token_ids) if extends else 0
        if extends and list(prompt_ids[:known]) != self.token_ids:
            mismatch = next((i for i, (a, b) in enumerate(zip(prompt_ids, self.token_ids)) if a != b),
                            min(len(prompt_ids), known))
            raise TokenDriftError(f"the policy's prompt diverges from the previous turn's tokens at index"
                                  f" {mismatch} of {known}; the policy server must extend previous_token_ids")
        self.last_turn_tokens = len(prompt_ids) + len(completion_ids)
        added = list(prompt_ids[known:])
        self.token_ids += added
        self.loss_mask += [0] * len(added)
        self.logprobs += [0.0] * len(added)
        # VersionSpan indices count completion tokens; shift them to trajectory indices.
        offset = len(self.token_ids)
        self.version_spans += [(offset + s.start, offset + s.end, s.policy_version) for s in spans if s.end > s.start]
        if sampling is not None and completion_ids:
            self.sampling_spans.append((offset, offset + len(completion_ids), *sampling))
        self.token_ids += completion_ids
        self.loss_mask += [1] * len(completion_ids)
        self.logprobs += [float(x) for x in logprobs]

    @property
    def counts(self) -> TokenCounts:
        completion = sum(self.loss_mask)
        return TokenCounts(prompt=len(self.token_ids) - completion, completion=completion)

    @property
    def versions(self) -> VersionRange:
        versions = [version for _, _, version in self.version_spans]
        return VersionRange(min=min(versions), max=max(versions)) if versions else VersionRange()


def read_rollouts(path: Path) -> Iterator[RolloutRecord]:
    """Records of a rollout file. A last line without its newline (a write cut short by a crash)
    is skipped; any other bad line is an error naming it."""
    if not path.exists():
        return
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.endswith("\n"):
                return  # the torn tail of an interrupted append
            if not line.strip():
                continue
            try:
                yield RolloutRecord.model_validate(json.loads(line))
            except ValueError as error:
                raise ValueError(f"{path}:{number} is not a {SCHEMA} record: {error}") from error


def drop_torn_tail(path: Path, chunk_bytes: int = 1 << 16) -> None:
    """Cut a last line that lacks its newline, so appends start on a fresh line. Reads the file
    backwards in chunks, so a large file costs only its tail."""
    if not path.exists():
        return
    with path.open("rb+") as file:
        end = file.seek(0, 2)
        position = end
        while position > 0:
            start = max(0, position - chunk_bytes)
            file.seek(start)
            chunk = file.read(position - start)
            if position == end and chunk.endswith(b"\n"):
                return
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                file.truncate(start + newline + 1)
                return
            position = start
        file.truncate(0)
