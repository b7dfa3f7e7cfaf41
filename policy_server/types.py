"""Plain data types of the policy server: what a backend takes and gives back. The requests
(chat messages, tool calls, GenerationRequest) are the library's (`sciproto.chat`) and the tensor
specs of weight updates the wire format's (`sciproto.weights.tensors`), named here for the backends.

The gRPC layer maps these to and from protobuf; backends never see protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from sciproto.chat import (  # noqa: F401 - the requests a backend takes, named here for the backends
    ChatMessage,
    GenerationRequest,
    SamplingParams,
    ToolCall,
)
from sciproto.lora import LoraSpec
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
class AdapterState:
    """A LoRA adapter a backend holds: what it is and the version of its last update."""

    spec: LoraSpec
    version: int


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
