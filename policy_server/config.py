"""Configuration of a policy server process (`sciproto serve policy`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from policy_server.backends.options import (
    AdapterOptions,
    OpenAIOptions,
    TransformersOptions,
    VllmSettings,
)
from sciproto.auth import AuthConfig
from sciproto.server import ServerConfig
from sciproto.tracing import TracingConfig
from sciproto.weights.rendezvous import CollectiveRendezvous


class WeightUpdateOptions(BaseModel):
    """Limits of UpdateWeights."""

    model_config = ConfigDict(extra="forbid")

    chunk_timeout_s: float = Field(
        120.0, gt=0, description="Longest wait for the next message of an update stream before it is refused"
    )
    refused_drain_s: float = Field(
        10.0, ge=0, description="Longest time the rest of a refused update is read and dropped before the refusal "
        "goes out, so that an asyncio gRPC client gets its code and reason rather than INTERNAL (grpc/grpc#36066)"
    )
    collective: CollectiveRendezvous | None = Field(
        None, description="The learner's collective weight-transfer group: gloo (transformers; vLLM on the CPU) or NCCL (vLLM on a GPU)"
    )


class PolicyServerConfig(BaseModel):
    """Everything a policy server process needs; `sciproto serve policy --set key=value` edits it."""

    model_config = ConfigDict(extra="forbid")

    server: ServerConfig = Field(default_factory=ServerConfig)
    model: str = Field("tiny", description='"tiny", "smollm2", or a local Hugging Face model directory')
    backend: Literal["transformers", "vllm", "openai"] = Field(
        "transformers", description="transformers (CPU, small GPU), vllm (GPU), or openai (an OpenAI-compatible server)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype the model is loaded and served in; auto: bfloat16 where the serving device "
        "multiplies bf16 natively (a CPU with AMX, a GPU with compute capability >= 8.0), float32 elsewhere")
    seed: int = Field(0, description="Seed of the random `tiny` model's weights")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens of a request that leaves it 0")
    max_samples_per_request: int = Field(64, ge=1, description="Largest n a Generate request may ask for")
    transformers: TransformersOptions = Field(default_factory=TransformersOptions)
    weights: WeightUpdateOptions = Field(default_factory=WeightUpdateOptions)
    adapters: AdapterOptions = Field(default_factory=AdapterOptions, description="LoRA adapters beside the base weights")
    max_hold_s: float = Field(
        300.0, gt=0, description="Longest a Hold may freeze generation before the server releases it")
    vllm: VllmSettings = Field(default_factory=VllmSettings, description="Settings of the vllm backend")
    openai: OpenAIOptions | None = Field(
        None, description="Settings of the openai backend: the endpoint it serves from (needed with backend openai)")
    auth: AuthConfig = Field(default_factory=AuthConfig, description="Bearer tokens and roles; off unless set")
    tracing: TracingConfig = Field(default_factory=TracingConfig, description="Span exporter; off by default")
