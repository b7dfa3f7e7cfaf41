"""The `vllm` backend: vLLM's AsyncLLM engine on GPU, with in-place weight updates.

Sampling: every request goes to the engine as prompt token ids (built by `policy_server.prompts`
from the model's Hugging Face tokenizer, so multi-turn extension is the same as in the
`transformers` backend) with `logprobs=0` under `logprobs_mode="processed_logprobs"`: the engine
returns the log-probability of each sampled token under the distribution it was drawn from, after
temperature and top-p. Outputs stream as deltas. A caller that leaves aborts its request.

Weights: updates go through vLLM's weight-transfer session (`start_weight_update`, loading,
`finish_weight_update`) with generation paused in "keep" mode: running requests freeze and resume
on the new weights, and the backend itself records which version sampled which tokens (see
`VllmBackend`). Two ways in, each worker call bounded by `collective_rpc(timeout=...)`:

- `update_weights(version, tensors)`: tensors that came as gRPC chunks are loaded into the model
  through a worker extension (`CheckpointTensorLoader`) inside that same update session;
- `receive_weights_nccl(version, specs)`: the tensors come over NCCL from the learner
  (`learner.vllm_sync`); the first call joins the learner's group (`NcclRendezvous`).

Every name of vLLM used here is listed in `policy_server.backends.vllm_api`, which a test checks
against the source of the pinned release.

Every prompt carries the policy version as its `cache_salt`, so the prefix cache never serves KV
computed by older weights to a request of a newer version.

vLLM is imported only when a backend is built: this module imports without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from policy_server.backends.base import CAPABILITIES as BASE_CAPABILITIES
from policy_server.prompts import prompt_token_ids
from policy_server.rendezvous import CollectiveRendezvous
from policy_server.toolcalls import parse_completion
from policy_server.types import (
    BackendInfo,
    FinishReason,
    GenerationRequest,
    SampleResult,
    SamplingParams,
    TensorSpec,
    TokenDelta,
    VersionSpan,
    dtype_from_name,
    dtype_name,
    validate_weight_update,
)

VLLM_MISSING = (
    "the vllm backend needs vLLM (a CUDA-only package): install the sciproto[vllm] extra on a "
    "machine with an NVIDIA GPU, or serve with backend=transformers"
)

CAPABILITIES = [*BASE_CAPABILITIES, "weight_updates_nccl"]

_FINISH_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


def import_vllm(module: str = "vllm") -> Any:
    """`module` of vLLM, or ImportError saying which extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(f"{VLLM_MISSING} ({error})") from error


# The rendezvous with the learner (NCCL rank 0); the same model configures the learner's side.
NcclRendezvous = CollectiveRendezvous


class VllmOptions(BaseModel):
    """Settings of the `vllm` backend: the `vllm:` section of a policy server config."""

    model_config = ConfigDict(extra="forbid")

    tensor_parallel_size: int = Field(1, ge=1, description="GPUs one model is split over")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="Share of GPU memory vLLM may take")
    max_model_len: int | None = Field(None, ge=1, description="Context size; the model's when unset")
    quantization: str = Field("", description='"" for none, or e.g. "fp8_per_block" (blockwise FP8)')
    enforce_eager: bool = Field(False, description="Skip CUDA graphs (faster start, slower decode)")
    enable_prefix_caching: bool = True
    trust_remote_code: bool = False
    seed: int = Field(0, description="Seed of vLLM's sampler for requests without their own seed")
    stall_timeout_s: float = Field(600.0, gt=0, description="Longest wait for the next output or update step")
    nccl: NcclRendezvous | None = Field(None, description="Rendezvous with the learner for NCCL updates")
    engine_args: dict[str, Any] = Field(default_factory=dict, description="More AsyncEngineArgs, as given")

    def engine_kwargs(self, model: str, dtype: str) -> dict[str, Any]:
        """Keyword arguments of vllm.AsyncEngineArgs."""
        kwargs: dict[str, Any] = {
            "model": model,
            "dtype": dtype,
            "seed": self.seed,
            "tensor_parallel_size": self.tensor_parallel_size,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "max_model_len": self.max_model_len,
            "quantization": self.quantization or None,
            "enforce_eager": self.enforce_eager,
            "enable_prefix_caching": self.enable_prefix_caching,
            "trust_remote_code": self.trust_remote_code,
            # logprobs after temperature and top-p: what the sampled token was drawn from
            "logprobs_mode": "processed_logprobs",
            # the update session (start/update/finish_weight_update) needs a transfer engine even
            # when tensors come as gRPC chunks; NCCL joins a group only when first used
            "weight_transfer_config": {"backend": "nccl"},
            "worker_extension_cls": f"{__name__}.CheckpointTensorLoader",
        }
        clashes = sorted(kwargs.keys() & self.engine_args.keys())
        if clashes:
            raise ValueError(f"vllm.engine_args sets {clashes}, which the backend sets itself; use the "
                             "vllm options of the same name")
        return kwargs | self.engine_args


def sampling_kwargs(sampling: SamplingParams, max_tokens: int) -> dict[str, Any]:
    """Keyword arguments of vllm.SamplingParams for `sampling` (output_kind is added by the
    caller). Samples of one request with a seed get seeds seed, seed+1, ... from vLLM itself."""
    return {
        "n": sampling.n,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_tokens": max_tokens,
        "stop": list(sampling.stop) or None,
        "include_stop_str_in_output": False,  # like the transformers backend: text ends before it
        "seed": sampling.seed,
        "logprobs": 0,  # only the sampled token's log-probability
        "skip_special_tokens": True,
    }


class CheckpointTensorLoader:
    """Worker extension (vLLM mixes it into its GPU worker, so `self` is the worker): loads
    checkpoint-format tensors sent through `collective_rpc` inside an update session that
    `start_weight_update` opened, the way vLLM's own transfer engines do."""

    def load_checkpoint_tensors(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            device = self.device  # type: ignore[attr-defined]
            model = self.weight_transfer_engine.model  # type: ignore[attr-defined]
            model.load_weights((name, tensor.to(device)) for name, tensor in named_tensors)
        torch.cuda.synchronize()


@dataclass
class _Sample:
    """What has streamed so far of one sample, and which version sampled which of its tokens."""

    marks: list[tuple[int, int]]  # (token index, version from that token on)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""


@dataclass(frozen=True)
class VllmTypes:
    """The vLLM classes the backend builds requests from (the real ones come from `load`)."""

    sampling_params: Callable[..., Any]
    delta_kind: Any

    @classmethod
    def load(cls) -> VllmTypes:
        return cls(import_vllm("vllm.sampling_params").SamplingParams,
                   import_vllm("vllm.sampling_params").RequestOutputKind.DELTA)


class VllmBackend:
    """PolicyBackend over a vLLM AsyncLLM; build it with `VllmBackend.start(model, dtype, options)`.

    Policy versions per token: vLLM 0.33 reports spans of its own (`CompletionOutput.weight_versions`),
    but the backend does not depend on them. It reads every request's outputs as they come (one
    reader task per request, independent of how fast the caller consumes), and an update runs with
    generation paused: every token read before the update commits was sampled by the old weights,
    every token after the resume by the new ones. So at the commit each running sample gets a mark
    (tokens so far, new version), exactly as in the transformers backend.

    Atomic updates: an update that fails before loading began resumes on the old weights; one that
    fails or times out after `start_weight_update` may have left layers half-loaded, so the engine
    stays paused, running requests end with finish reason "abort", `info().unavailable` says why,
    and Generate is refused until a later update completes."""

    def __init__(self, engine: Any, tokenizer: Any, model: str, dtype: str, options: VllmOptions,
                 manifest: list[TensorSpec], stop_token_ids: frozenset[int], max_context: int,
                 types: VllmTypes | None = None) -> None:
        self._engine = engine
        self._tokenizer = tokenizer
        self._model = model
        self._dtype = dtype
        self._options = options
        self._manifest = manifest
        self._stop_token_ids = stop_token_ids
        self._max_context = max_context
        self._version = 0
        self._update_lock = asyncio.Lock()
        self._nccl_joined = False
        self._running: dict[str, list[_Sample]] = {}
        self._paused = False
        self._unavailable = ""
        self._closed = False
        self._types = types or VllmTypes.load()

    @classmethod
    def start(cls, model: str, dtype: str, options: VllmOptions) -> VllmBackend:
        """Start the engine on `model` (a Hugging Face model directory or hub id)."""
        arg_utils = import_vllm("vllm.engine.arg_utils")
        async_llm = import_vllm("vllm.v1.engine.async_llm")
        tokenizer, stop_ids, manifest = _model_facts(model, dtype, options.trust_remote_code)
        engine_args = arg_utils.AsyncEngineArgs(**options.engine_kwargs(model, dtype))
        engine = async_llm.AsyncLLM.from_engine_args(engine_args)
        max_context = engine.model_config.max_model_len
        return cls(engine, tokenizer, model, dtype, options, manifest, stop_ids, max_context)

    # -- PolicyBackend -------------------------------------------------------------------------

    def info(self) -> BackendInfo:
        return BackendInfo(
            model=self._model,
            backend="vllm",
            dtype=self._dtype,
            quantization=self._options.quantization,
            max_context=self._max_context,
            policy_version=self._version,
            capabilities=list(CAPABILITIES),
            supports_weight_updates=True,
            unavailable=self._unavailable,
        )

    def prompt_token_ids(self, request: GenerationRequest) -> list[int]:
        return prompt_token_ids(self._tokenizer, request, self._stop_token_ids)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta | SampleResult]:
        if self._closed:
            raise RuntimeError("backend is closed")
        if self._unavailable:
            raise RuntimeError(self._unavailable)
        prompt = self.prompt_token_ids(request)
        room = self._max_context - len(prompt)
        if room < 1:
            raise ValueError(f"prompt has {len(prompt)} tokens; the model's context is {self._max_context}")
        params = self._types.sampling_params(
            **sampling_kwargs(request.sampling, min(request.sampling.max_tokens, room)),
            output_kind=self._types.delta_kind)
        version = self._version
        engine_prompt = {"prompt_token_ids": prompt, "cache_salt": f"policy-v{version}"}
        request_id = f"{request.request_id or 'generate'}-{uuid.uuid4().hex}"
        samples = [_Sample([(0, version)]) for _ in range(request.sampling.n)]
        events: asyncio.Queue = asyncio.Queue()
        self._running[request_id] = samples
        outputs = self._engine.generate(engine_prompt, params, request_id)
        reader = asyncio.ensure_future(_read_outputs(outputs, samples, prompt, events, request_id))
        unfinished = request.sampling.n
        try:
            while unfinished:
                event = await asyncio.wait_for(events.get(), self._options.stall_timeout_s)
                if isinstance(event, BaseException):
                    raise event
                if isinstance(event, SampleResult):
                    unfinished -= 1
                yield event
        finally:
            self._running.pop(request_id, None)
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            if unfinished:  # the caller left early (or the engine failed): free the engine's slots
                await self._engine.abort(request_id)
            await outputs.aclose()

    def weight_manifest(self) -> list[TensorSpec]:
        return list(self._manifest)

    async def update_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Install tensors that arrived as gRPC chunks (checkpoint names, e.g. q_proj, which
        vLLM fuses into its own layout as it loads them)."""
        validate_weight_update(self._manifest, tensors)
        named = list(tensors.items())
        timeout = self._options.stall_timeout_s
        async with self._update_lock:
            await self._swap_locked(version, lambda: self._engine.collective_rpc(
                "load_checkpoint_tensors", timeout=timeout, args=(named,)))

    async def receive_weights_nccl(self, version: int, specs: list[TensorSpec]) -> None:
        """Install tensors the learner broadcasts over NCCL, in the order of `specs` (the
        UpdateWeights header); returns when every worker has loaded them. The first call joins
        the learner's NCCL group, which the learner opens at the same time."""
        rendezvous = self._options.nccl
        if rendezvous is None:
            raise ValueError("this server has no vllm.nccl rendezvous configured; send the weights as gRPC "
                             "chunks or configure vllm.nccl to match the learner's nccl settings")
        validate_weight_update(self._manifest, _meta_tensors(specs))
        update_info = {
            "names": [spec.name for spec in specs],
            "dtype_names": [spec.dtype for spec in specs],
            "shapes": [list(spec.shape) for spec in specs],
        }
        timeout = min(self._options.stall_timeout_s, rendezvous.timeout_s)
        async with self._update_lock:
            if not self._nccl_joined:
                await asyncio.wait_for(self._engine.collective_rpc(
                    "init_weight_transfer_engine", timeout=timeout,
                    kwargs={"init_info": rendezvous.worker_init_info()}), timeout)
                self._nccl_joined = True
            await self._swap_locked(version, lambda: self._engine.collective_rpc(
                "update_weights", timeout=timeout, kwargs={"update_info": update_info}))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._running:
            # running samples end with finish reason "abort", as the protocol promises
            await self._engine.abort(list(self._running))
        if self._nccl_joined and not self._unavailable:
            await self._engine.shutdown_weight_transfer_engine()
        self._engine.shutdown()

    # -- weight swap ---------------------------------------------------------------------------

    async def _swap_locked(self, version: int, load: Callable[[], Awaitable[Any]]) -> None:
        """Pause (running requests freeze in place), load inside an update session, label the
        weights `version`, mark every running sample, resume. A failure after loading began
        leaves the engine paused and the backend unavailable (see the class docstring)."""
        if self._closed:
            raise RuntimeError("backend is closed")
        if version <= self._version:
            raise ValueError(f"version {version} is not newer than the serving version {self._version}")
        timeout = self._options.stall_timeout_s
        if not self._paused:
            # the prefix cache stays: new prompts carry the new version as cache_salt and never hit it
            await asyncio.wait_for(self._engine.pause_generation(mode="keep", clear_cache=False), timeout)
            self._paused = True
        try:
            await asyncio.wait_for(self._engine.start_weight_update(), timeout)
        except BaseException:
            if not self._unavailable:  # nothing was loaded: the old weights are whole
                await self._resume(timeout)
            raise
        try:
            await asyncio.wait_for(load(), timeout)
            await asyncio.wait_for(self._engine.finish_weight_update(weight_version=str(version)), timeout)
        except BaseException as error:
            self._unavailable = (f"the update to policy version {version} failed after it began loading ({error!r}); "
                                 "the weights may be half-loaded, so this server samples again only after a "
                                 "complete update")
            if self._running:  # they cannot go on: end them with finish reason "abort"
                await self._engine.abort(list(self._running))
            raise
        # Paused, nothing new is sampled: let each reader take what was sampled before the pause.
        for _ in range(3):
            await asyncio.sleep(0)
        self._version = version
        self._unavailable = ""
        for samples in self._running.values():
            for sample in samples:
                sample.marks.append((len(sample.tokens), version))
        await self._resume(timeout)

    async def _resume(self, timeout: float) -> None:
        await asyncio.wait_for(self._engine.resume_generation(), timeout)
        self._paused = False


async def _read_outputs(outputs: AsyncIterator[Any], samples: list[_Sample], prompt: list[int],
                        events: asyncio.Queue, request_id: str) -> None:
    """Read one request's DELTA outputs as they come: tokens go into their samples at once (so an
    update's mark counts them), events go to the caller's queue."""
    unfinished = len(samples)
    try:
        async for output in outputs:
            for completion in output.outputs:
                sample = samples[completion.index]
                delta = _delta(sample, completion)
                if delta.token_ids or delta.text:
                    events.put_nowait(delta)
                if completion.finish_reason is not None:
                    unfinished -= 1
                    events.put_nowait(_result(completion, sample, prompt))
        if unfinished:
            events.put_nowait(RuntimeError(f"vLLM ended request {request_id} with {unfinished} samples unfinished"))
    except Exception as error:  # noqa: BLE001 -- handed to the caller
        events.put_nowait(error)


def _delta(sample: _Sample, completion: Any) -> TokenDelta:
    """Append one DELTA CompletionOutput to `sample` and return it as a TokenDelta."""
    tokens = list(completion.token_ids)
    if completion.logprobs is None or len(completion.logprobs) != len(tokens):
        raise RuntimeError("vLLM returned no logprob for a sampled token; the request must ask for logprobs=0")
    # each position holds at least the sampled token's entry: {token_id: Logprob(logprob, ...)}
    logprobs = [position[token].logprob for position, token in zip(completion.logprobs, tokens)]
    sample.tokens += tokens
    sample.logprobs += logprobs
    sample.text += completion.text
    return TokenDelta(completion.index, tokens, completion.text, logprobs)


def _result(completion: Any, sample: _Sample, prompt: list[int]) -> SampleResult:
    finish = _FINISH_REASONS.get(completion.finish_reason)
    if finish is None:
        raise RuntimeError(f"vLLM ended sample {completion.index} with {completion.finish_reason!r}")
    parsed = parse_completion(sample.text)
    return SampleResult(
        sample_index=completion.index,
        prompt_token_ids=prompt,
        completion_token_ids=sample.tokens,
        logprobs=sample.logprobs,
        finish_reason=finish,
        text=sample.text,
        content=parsed.content,
        tool_calls=parsed.tool_calls,
        malformed=parsed.malformed,
        version_spans=version_spans(sample.marks, len(sample.tokens)),
    )


def version_spans(marks: list[tuple[int, int]], length: int) -> list[VersionSpan]:
    """[(first token, version), ...] -> the non-empty spans covering tokens [0, length)."""
    ends = [start for start, _ in marks[1:]] + [length]
    return [VersionSpan(start, end, version) for (start, version), end in zip(marks, ends) if end > start]


def _meta_tensors(specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
    """Shape-and-dtype stand-ins of `specs` (no memory), to check a header against the manifest."""
    if len({spec.name for spec in specs}) != len(specs):
        raise ValueError("the weight update names a tensor twice")
    return {spec.name: torch.empty(spec.shape, dtype=dtype_from_name(spec.dtype), device="meta") for spec in specs}


def _model_facts(model: str, dtype: str, trust_remote_code: bool) -> tuple[Any, frozenset[int], list[TensorSpec]]:
    """The model's HF tokenizer (with the chat template the transformers backend would use),
    its stop token ids, and its checkpoint-format manifest, read from a weightless (meta) copy."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from policy_server.models.chat_template import chatml_tool_template
    from policy_server.models.loading import _stop_token_ids

    tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
    if tokenizer.chat_template is None:
        tokenizer.chat_template = chatml_tool_template()
    config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype),
                                                    trust_remote_code=trust_remote_code)
    with contextlib.suppress(OSError):  # a model without generation_config.json keeps the default
        skeleton.generation_config = GenerationConfig.from_pretrained(model)
    manifest = [TensorSpec(name, tuple(param.shape), dtype_name(param.dtype))
                for name, param in skeleton.named_parameters()]
    return tokenizer, _stop_token_ids(skeleton, tokenizer), manifest


def build_backend(config: Any) -> VllmBackend:
    """The hook `policy_server.app` calls: a started backend for a PolicyServerConfig whose
    `vllm:` section holds VllmOptions."""
    return VllmBackend.start(config.model, config.dtype, VllmOptions(**config.vllm))
