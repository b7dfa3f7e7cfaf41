"""The vllm backend. Without vLLM (a CUDA-only package) only what needs no engine runs here: the
module imports, errors name the extra to install, sampling and engine options map as intended,
the manifest and tokenizer come from a model directory. With vLLM and a GPU, the engine tests run:
generation, logprob shapes and an in-place weight update that changes the outputs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from learner.server_config import LearnerServerConfig
from policy_server.app import build_backend as app_build_backend
from policy_server.backends import vllm_backend
from policy_server.backends.vllm_backend import (
    NcclRendezvous,
    VllmOptions,
    _model_facts,
    sampling_kwargs,
    version_spans,
)
from policy_server.config import PolicyServerConfig
from policy_server.models import load_model
from policy_server.prompts import prompt_token_ids
from policy_server.types import (
    ChatMessage,
    GenerationRequest,
    SampleResult,
    SamplingParams,
    VersionSpan,
)

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_no_vllm = pytest.mark.skipif(HAS_VLLM, reason="checks the error shown when vLLM is not installed")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The `tiny` model saved as a Hugging Face directory, as vLLM loads models."""
    path = tmp_path_factory.mktemp("tiny-hf")
    loaded = load_model("tiny", seed=0)
    loaded.model.save_pretrained(path)
    loaded.tokenizer.save_pretrained(path)
    return path


@needs_no_vllm
def test_missing_vllm_names_the_extra():
    config = PolicyServerConfig(backend="vllm", model="unused")
    with pytest.raises(ImportError, match=r"sciproto\[vllm\]"):
        app_build_backend(config)


@needs_no_vllm
def test_missing_vllm_stops_the_nccl_pusher_with_the_extra_named():
    from learner.vllm_sync import build_weight_pusher

    config = LearnerServerConfig(push_transport="nccl", policy_targets=["127.0.0.1:1"], device="cuda:0",
                                 nccl={"master_address": "127.0.0.1", "master_port": 29600, "world_size": 2})
    with pytest.raises(ImportError, match=r"sciproto\[vllm\]"):
        build_weight_pusher(config)


def test_nccl_pusher_refuses_a_cpu_learner():
    from learner.vllm_sync import NcclWeightPusher

    rendezvous = NcclRendezvous(master_address="127.0.0.1", master_port=29600, world_size=2)
    with pytest.raises(ValueError, match="CUDA device"):
        NcclWeightPusher(["127.0.0.1:1"], rendezvous, "cpu", timeout_s=5)


def test_sampling_params_map_to_vllm_keywords():
    sampling = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=50, stop=["\n\n"], seed=11, n=4)
    kwargs = sampling_kwargs(sampling, max_tokens=20)
    assert kwargs == {
        "n": 4, "temperature": 0.7, "top_p": 0.9, "max_tokens": 20, "stop": ["\n\n"],
        "include_stop_str_in_output": False, "seed": 11, "logprobs": 0, "skip_special_tokens": True,
    }
    assert sampling_kwargs(SamplingParams(), 5)["stop"] is None  # vLLM: no stop strings


def test_engine_options_ask_for_processed_logprobs_and_weight_transfer():
    options = VllmOptions(quantization="fp8_per_block", engine_args={"max_num_seqs": 64})
    kwargs = options.engine_kwargs("/models/x", "bfloat16")
    assert kwargs["logprobs_mode"] == "processed_logprobs"
    assert kwargs["quantization"] == "fp8_per_block"
    assert kwargs["weight_transfer_config"] == {"backend": "nccl"}
    assert kwargs["max_num_seqs"] == 64
    module, _, name = kwargs["worker_extension_cls"].rpartition(".")
    assert getattr(importlib.import_module(module), name) is vllm_backend.CheckpointTensorLoader
    assert VllmOptions().engine_kwargs("m", "float16")["quantization"] is None
    with pytest.raises(ValueError, match="logprobs_mode"):
        VllmOptions(engine_args={"logprobs_mode": "raw_logprobs"}).engine_kwargs("m", "float16")


def test_nccl_rendezvous_is_the_worker_init_info():
    rendezvous = NcclRendezvous(master_address="10.0.0.1", master_port=29600, world_size=3, rank_offset=2)
    assert rendezvous.worker_init_info() == {"master_address": "10.0.0.1", "master_port": 29600,
                                             "rank_offset": 2, "world_size": 3, "packed": True}
    with pytest.raises(ValueError):
        NcclRendezvous(master_address="h", master_port=29600, world_size=1)


def test_version_spans_from_marks():
    assert version_spans([(0, 0), (5, 3)], 9) == [VersionSpan(0, 5, 0), VersionSpan(5, 9, 3)]
    assert version_spans([(0, 2)], 4) == [VersionSpan(0, 4, 2)]
    assert version_spans([(0, 2)], 0) == []
    assert version_spans([(0, 1), (0, 2)], 3) == [VersionSpan(0, 3, 2)]  # an update before any token


def test_model_facts_match_the_transformers_backend(model_dir):
    tokenizer, stop_ids, manifest = _model_facts(str(model_dir), "float32", trust_remote_code=False)
    reference = load_model(str(model_dir))
    assert stop_ids == reference.stop_token_ids
    assert [(s.name, s.shape, s.dtype) for s in manifest] == [
        (name, tuple(p.shape), "float32") for name, p in reference.model.named_parameters()]
    request = GenerationRequest(messages=[ChatMessage("user", "2+2?")])
    assert prompt_token_ids(tokenizer, request, stop_ids) == prompt_token_ids(
        reference.tokenizer, request, reference.stop_token_ids)


# -- with vLLM on a GPU -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_backend(model_dir):
    pytest.importorskip("vllm", reason="vLLM is not installed (CUDA-only: the sciproto[vllm] extra)")
    if not torch.cuda.is_available():
        pytest.skip("vLLM needs a CUDA GPU")
    options = VllmOptions(enforce_eager=True, gpu_memory_utilization=0.3, max_model_len=512)
    backend = vllm_backend.VllmBackend.start(str(model_dir), "float32", options)
    yield backend
    import asyncio

    asyncio.run(backend.close())


async def _samples(backend, request) -> list[SampleResult]:
    results = [event async for event in backend.generate(request) if isinstance(event, SampleResult)]
    return sorted(results, key=lambda r: r.sample_index)


async def test_engine_generates_with_one_logprob_per_token(engine_backend):
    request = GenerationRequest(messages=[ChatMessage("user", "hello")],
                                sampling=SamplingParams(n=3, max_tokens=16, seed=5))
    results = await _samples(engine_backend, request)
    assert [r.sample_index for r in results] == [0, 1, 2]
    for result in results:
        assert 0 < len(result.completion_token_ids) <= 16
        assert len(result.logprobs) == len(result.completion_token_ids)
        assert all(value <= 0 for value in result.logprobs)
        assert result.version_spans == [VersionSpan(0, len(result.completion_token_ids), 0)]


async def test_engine_update_in_place_changes_outputs(engine_backend, model_dir):
    greedy = GenerationRequest(prompt_token_ids=[10, 20, 30], sampling=SamplingParams(temperature=0, max_tokens=12))
    before = (await _samples(engine_backend, greedy))[0]
    other = dict(load_model("tiny", seed=1).model.named_parameters())
    await engine_backend.update_weights(1, {spec.name: other[spec.name].detach()
                                            for spec in engine_backend.weight_manifest()})
    after = (await _samples(engine_backend, greedy))[0]
    assert engine_backend.info().policy_version == 1
    assert (after.completion_token_ids, after.logprobs) != (before.completion_token_ids, before.logprobs)
    assert {span.version for span in after.version_spans} == {1}
