"""Plain data types of the policy server: what a backend takes and gives back. The tensor specs of
weight updates are the wire format's (`sciproto.weights.tensors`), named here for the backends.

The gRPC layer maps these to and from protobuf; backends never see protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from pydantic import Field

from sciproto.sampling import Sampling
from sciproto.weights.tensors import (  # noqa: F401 - named here for the backends
    TensorSpec,
    WeightUpdateManifest,
    dtype_from_name,
    dtype_name,
    validate_weight_update,
)


class FinishReason(str, Enum):
    STOP = "stop"  # a stop token or stop string ended the sample
    LENGTH = "length"  # max_tokens or the model's context ran out
    ABORT = "abort"  # the caller went away or the backend closed


@dataclass(frozen=True)
class ToolCall:
    """One function call the model asked for; `arguments` is a JSON object as a string."""

    id: str
    name: str
    arguments: str


@dataclass
class ChatMessage:
    """An OpenAI-style chat message. Assistant messages may carry tool calls; tool messages
    answer one call by `tool_call_id`."""

    role: str
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ("system", "user", "assistant", "tool"):
            raise ValueError(
                f"message role {self.role!r} is not one of system, user, assistant, tool"
            )

    def to_template_dict(self) -> dict[str, Any]:
        """The dict shape chat templates expect (OpenAI chat format)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class SamplingParams(Sampling):
    """How to sample (sciproto.sampling.Sampling: temperature 0 is greedy; seed None draws fresh
    entropy per request), and how many samples of the prompt to draw."""

    n: int = Field(1, ge=1, description="Samples drawn from the same prompt (a GRPO group)")


@dataclass
class GenerationRequest:
    """Either chat `messages` (+ `tools`, OpenAI function schemas) or raw `prompt_token_ids`.

    For a later turn of a chat, `previous_token_ids` holds the exact prompt + completion ids of the
    previous turn; the new prompt is those ids followed by the tokens of what the conversation
    added since, so earlier ids are never re-tokenized.
    """

    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None
    previous_token_ids: list[int] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = ""

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.prompt_token_ids is None):
            raise ValueError("give exactly one of messages or prompt_token_ids")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise ValueError("prompt_token_ids is empty")
        if self.prompt_token_ids is not None and (self.tools or self.previous_token_ids):
            raise ValueError("tools and previous_token_ids only apply to chat messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages is empty")


@dataclass(frozen=True)
class TokenDelta:
    """Tokens sampled since the last delta of one sample, streamed while sampling."""

    sample_index: int
    token_ids: list[int]
    text: str
    logprobs: list[float]


@dataclass(frozen=True)
class VersionSpan:
    """Completion tokens [start, end) were sampled by policy version `version`."""

    start: int
    end: int
    version: int


@dataclass
class SampleResult:
    """One finished sample. `text` is the whole completion text (stop token and stop string
    excluded); `content` is that text without the parsed tool-call blocks."""

    sample_index: int
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    text: str
    content: str
    tool_calls: list[ToolCall]
    malformed: bool
    version_spans: list[VersionSpan]


@dataclass(frozen=True)
class BackendInfo:
    model: str
    backend: str
    dtype: str
    quantization: str  # "" when none
    max_context: int
    policy_version: int
    capabilities: list[str]
    supports_weight_updates: bool
    # Why the backend cannot sample now ("" when it can): an update failed after it began
    # changing the weights, so they may be half-loaded until a complete update succeeds.
    unavailable: str = ""
