"""The settings of the policy backends: the `transformers:`, `vllm:` and `openai:` sections of a
policy server config. Plain pydantic models that import neither vLLM nor torch, so the configuration
(`PolicyServerConfig`) validates and documents them wherever it is loaded; each backend module
builds from them (`policy_server.backends.vllm_backend.VllmOptions` adds the engine's keywords).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from sciproto.units import GiB


class TransformersOptions(BaseModel):
    """Settings of the `transformers` backend (dynamic batching over one in-process model)."""

    model_config = ConfigDict(extra="forbid")

    batch_window_s: float = Field(0.005, ge=0, description="How long an idle engine waits to batch arrivals")
    max_batch_rows: int = Field(256, ge=1, description="Most samples decoded together")
    stream_interval: int = Field(8, ge=1, description="Tokens a sample gathers before a delta goes out")
    device: str = Field("cpu", description='Torch device of the model, e.g. "cpu" or "cuda:0"')


class AdapterOptions(BaseModel):
    """LoRA adapters served beside the base weights (protocol 1.4): the `adapters:` section.

    The transformers backend holds adapters at no cost to base requests, so it takes 4 unless told
    otherwise. vLLM must reserve them when its engine starts, and on the CPU its LoRA kernels slow
    every request by how large `max_rank` is (SmolLM2: base requests at ~0.65x the tokens/s with
    max_rank 64, ~1.0x with 8; policy_server.backends.vllm_lora), so it takes none unless
    `max_adapters` is set; `sciproto train` with learner.lora sizes its own server to its adapter."""

    model_config = ConfigDict(extra="forbid")

    max_adapters: int | None = Field(
        None, ge=0, le=64, description="Most adapters held at once (0: take none; unset: 4 on transformers, 0 on vllm)"
    )
    max_rank: int = Field(64, ge=1, le=1024, description="Highest LoRA rank an adapter may have (vllm: the smaller "
                          "the faster every request runs)")

    def held(self, backend: str) -> int:
        """How many adapters a server of `backend` holds at once."""
        if self.max_adapters is not None:
            return self.max_adapters
        return 0 if backend == "vllm" else 4


class VllmSettings(BaseModel):
    """Settings of the `vllm` backend: the `vllm:` section of a policy server config."""

    model_config = ConfigDict(extra="forbid")

    tensor_parallel_size: int = Field(1, ge=1, description="GPUs (or CPU worker processes) one model is split over")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="Share of GPU memory vLLM may take (GPU)")
    kv_cache_bytes: int = Field(1 * GiB, gt=0, description="Size of the KV cache on the CPU (a GPU sizes it from "
                                "gpu_memory_utilization)")
    max_model_len: int | None = Field(None, ge=1, description="Context size; the model's when unset")
    quantization: str = Field("", description='"" for none, or e.g. "fp8_per_block" (blockwise FP8)')
    enforce_eager: bool = Field(False, description="Skip CUDA graphs (faster start, slower decode)")
    enable_prefix_caching: bool = Field(True, description="Reuse the KV cache of a prompt prefix seen before")
    trust_remote_code: bool = Field(False, description="Let the model directory's own code run (Hugging Face)")
    seed: int = Field(0, description="Seed of vLLM's sampler for requests without their own seed")
    stall_timeout_s: float = Field(600.0, gt=0, description="Longest wait for the next output or update step")
    engine_args: dict[str, Any] = Field(default_factory=dict, description="More AsyncEngineArgs, as given")


class OpenAIOptions(BaseModel):
    """Settings of the `openai` backend: the `openai:` section of a policy server config."""

    model_config = ConfigDict(extra="forbid")

    base_url: str = Field(description='Endpoint root including the version, e.g. "http://host:8000/v1"')
    model: str = Field("", description="Model name sent to the endpoint; the server config's model when empty")
    api_key_env: str = Field("", description="Name of the environment variable holding the API key; none when empty")
    token_ids: bool = Field(False, description="Ask for token ids (return_token_ids) and require them")
    max_context: int = Field(32768, ge=2, description="Context size of the served model, in tokens")
    connect_timeout_s: float = Field(10.0, gt=0, description="Longest wait to connect")
    read_timeout_s: float = Field(120.0, gt=0, description="Longest wait for the next bytes of an answer")
    max_attempts: int = Field(3, ge=1, le=10, description="Tries of one request in all, the first included")
    backoff_s: float = Field(0.5, ge=0, description="Wait before the 2nd try; doubles after each")
    max_backoff_s: float = Field(10.0, ge=0, description="Longest wait between tries, Retry-After included")


__all__ = ["AdapterOptions", "OpenAIOptions", "TransformersOptions", "VllmSettings"]
