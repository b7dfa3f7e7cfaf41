"""The checks that need a GPU, in one run sized for one H200 (under 8 minutes); prints JSON.

Uses only the machine's own torch and transformers (plus torchao for FP8); never vLLM.

1. transformers backend on CUDA: Generate with n samples; an in-place update to other weights,
   after which greedy tokens and their logprobs must match a reference forward of those weights.
2. UpdateWeights through a real gRPC server (in this process) on the GPU: seconds per GB of a
   ~0.5B-parameter bf16 model, against the same bytes copied device to device in this process
   (the strongest baseline: no serialization, no transport).
3. The learner's step (GRPOTrainer, `precision` bf16 and fp8) on a ~0.5B model built from a config
   with fp32 weights given to the trainer (the trainer keeps them as master weights where it does;
   `master_dtype` reports what it holds): step time, and the logprob mismatch of each precision's
   forward against fp32 on the same tokens (mean exp|log p - log p_fp32|, 1.0 = identical).

`--dry-run` runs every part on the CPU with a small model (fp8-emulated for fp8), to check the
script itself on a machine without a GPU. Usage: python bench/gpu_check.py [--dry-run]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import random
import signal
import statistics
import sys
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from learner.config import GRPOConfig
from learner.trainer import GRPOTrainer
from learner.types import RolloutGroup, TrainSample
from policy_server.backends.registry import backend_plugin
from policy_server.backends.transformers_backend import TransformersBackend
from policy_server.config import PolicyServerConfig
from policy_server.service import PolicyServicer, register
from policy_server.types import GenerationRequest, SampleResult, SamplingParams
from sciproto.client.policy import PolicyClient, push_weights_to_all
from sciproto.models import load_model
from sciproto.pb import POLICY_SERVICE
from sciproto.server import ServerConfig, Service, start_server

LARGE = {"vocab_size": 32768, "hidden_size": 1024, "intermediate_size": 5632, "num_hidden_layers": 24,
         "num_attention_heads": 16, "num_key_value_heads": 4, "max_position_embeddings": 2048,
         "tie_word_embeddings": True}  # ~0.51B parameters; linear dims multiples of 16 (FP8)
SMALL = {**LARGE, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}


def build_model(config: dict, device: str, seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**config)).float().to(device)


def token_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# -- 1. the transformers backend on the device ------------------------------------------------------


async def backend_check(device: str) -> dict:
    backend = TransformersBackend(load_model("tiny", torch.float32, 0, device), stream_interval=4)
    try:
        request = GenerationRequest(prompt_token_ids=[11, 12, 13, 14],
                                    sampling=SamplingParams(n=4, max_tokens=24, seed=3))
        started = time.perf_counter()
        samples = [e async for e in backend.generate(request) if isinstance(e, SampleResult)]
        generate_s = time.perf_counter() - started
        other = load_model("tiny", torch.float32, 1, device).model
        await backend.update_weights(1, {name: p.detach() for name, p in other.named_parameters()})
        greedy = GenerationRequest(prompt_token_ids=[11, 12, 13, 14], sampling=SamplingParams(temperature=0, max_tokens=12))
        (after,) = [e async for e in backend.generate(greedy) if isinstance(e, SampleResult)]
        ids = torch.tensor([[11, 12, 13, 14, *after.completion_token_ids]], device=device)
        expected = token_logprobs(other, ids)[0, 3:].tolist()
        error = max(abs(a - b) for a, b in zip(expected, after.logprobs))
        return {"generate_s": generate_s, "samples": len(samples),
                "distinct_samples": len({tuple(s.completion_token_ids) for s in samples}),
                "version_after_update": backend.info().policy_version,
                "after_update_max_logprob_error": error, "after_update_matches_reference": error < 1e-3,
                "version_spans_after": [(s.start, s.end, s.version) for s in after.version_spans]}
    finally:
        await backend.close()


# -- 2. UpdateWeights seconds per GB -------------------------------------------------------------


class _Loaded:
    """A LoadedModel-like holder for a model built from a config (no tokenizer needed for updates)."""

    def __init__(self, model: torch.nn.Module, tokenizer) -> None:
        self.model, self.tokenizer, self.name, self.max_context = model, tokenizer, "gpu-check", 2048
        self.stop_token_ids = frozenset()


async def update_weights_check(config: dict, device: str, repeats: int) -> dict:
    tokenizer = load_model("tiny").tokenizer
    served = build_model(config, device).to(torch.bfloat16)
    backend = TransformersBackend(_Loaded(served, tokenizer))
    servicer = PolicyServicer(backend, lambda request: list(request.prompt_token_ids), PolicyServerConfig(),
                              capabilities=backend_plugin("transformers").capabilities)
    running = await start_server(ServerConfig(port=0), [Service(POLICY_SERVICE, servicer, register)])
    try:
        weights = {name: p.detach().clone() for name, p in build_model(config, device, seed=1)
                   .to(torch.bfloat16).named_parameters()}
        gigabytes = sum(t.numel() * t.element_size() for t in weights.values()) / 1e9
        grpc_s, copy_s = [], []
        async with PolicyClient(f"127.0.0.1:{running.port}") as client:
            for version in range(1, repeats + 1):
                synchronize(device)
                started = time.perf_counter()
                await push_weights_to_all([client], weights, version, timeout_s=600)
                synchronize(device)
                grpc_s.append(time.perf_counter() - started)
        targets = dict(served.named_parameters())
        for _ in range(repeats):
            synchronize(device)
            started = time.perf_counter()
            with torch.no_grad():
                for name, tensor in weights.items():
                    targets[name].copy_(tensor)
            synchronize(device)
            copy_s.append(time.perf_counter() - started)
        grpc_median, copy_median = statistics.median(grpc_s), statistics.median(copy_s)
        return {"gigabytes": gigabytes, "grpc_s_per_gb": grpc_median / gigabytes,
                "in_process_copy_s_per_gb": copy_median / gigabytes,
                "ratio_grpc_over_copy": grpc_median / max(copy_median, 1e-9), "repeats": repeats}
    finally:
        await running.stop()


# -- 3. learner steps --------------------------------------------------------------------------------


def synthetic_groups(vocab: int, prompt: int, completion: int, groups: int, samples: int,
                     seed: int = 0) -> list[RolloutGroup]:
    rng = random.Random(seed)
    mask = [0] * prompt + [1] * completion
    return [RolloutGroup(group_id=str(g), task="gpu-check", samples=[
        TrainSample(token_ids=[rng.randrange(vocab) for _ in mask], loss_mask=mask,
                    rollout_logprobs=[-10.4 * m for m in mask], policy_versions=[0 if m else -1 for m in mask],
                    reward=float(i % 2), sample_index=i) for i in range(samples)]) for g in range(groups)]


def learner_check(config: dict, device: str, precisions: list[str], steps: int, shape: tuple[int, int, int, int]) -> dict:
    prompt, completion, groups_n, samples_n = shape
    fp32 = build_model(config, device)
    groups = synthetic_groups(config["vocab_size"], prompt, completion, groups_n, samples_n)
    eval_ids = torch.tensor([g.samples[0].token_ids for g in synthetic_groups(
        config["vocab_size"], prompt, completion, groups_n, samples_n, seed=1)], device=device)
    reference = token_logprobs(fp32, eval_ids)
    results: dict[str, dict] = {"params": sum(p.numel() for p in fp32.parameters())}
    for precision in precisions:
        trainer = GRPOTrainer(copy.deepcopy(fp32), GRPOConfig(
            precision=precision, lr=1e-5, micro_batch_tokens=groups_n * samples_n * (prompt + completion)))
        compute = getattr(trainer, "compute", None)  # the trainer's forward precision (bf16 autocast), if it has one
        with compute() if compute is not None else contextlib.nullcontext():
            logprobs = token_logprobs(trainer.model, eval_ids)
        mismatch = torch.exp((logprobs - reference).abs()).mean().item()
        times = []
        for _ in range(steps):
            synchronize(device)
            started = time.perf_counter()
            metrics = trainer.train_step(groups)
            synchronize(device)
            times.append(time.perf_counter() - started)
        results[precision] = {
            "mismatch_vs_fp32": mismatch, "step_s_median": statistics.median(times[1:] or times),
            "loss": metrics.loss, "master_dtype": str(next(trainer.model.parameters()).dtype).removeprefix("torch."),
            "optimizer_state_dtypes": sorted({str(v.dtype).removeprefix("torch.") for s in trainer.optimizer.state.values()
                                              for v in s.values() if torch.is_tensor(v) and v.dim()}),
        }
        del trainer
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    low = [p for p in precisions if p != "bf16"]
    if "bf16" in results and low:
        results["step_speedup_fp8_over_bf16"] = results["bf16"]["step_s_median"] / results[low[0]]["step_s_median"]
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="every part on the CPU with a small model")
    parser.add_argument("--budget-s", type=int, default=480, help="stop and print what was measured after this long")
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        print("bench/gpu_check.py: no CUDA device here; run it on a GPU, or pass --dry-run to check the "
              "script on the CPU", file=sys.stderr)
        return 2
    device = "cpu" if args.dry_run else "cuda"
    config = SMALL if args.dry_run else LARGE
    started = time.perf_counter()
    report: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)",
                    "torch": torch.__version__, "dry_run": args.dry_run}

    def out_of_time(signum: int, frame: object) -> None:
        raise TimeoutError(f"the run passed its budget of {args.budget_s} s")

    signal.signal(signal.SIGALRM, out_of_time)
    signal.alarm(args.budget_s)
    status = 0
    try:
        report["backend"] = asyncio.run(backend_check(device))
        report["update_weights"] = asyncio.run(update_weights_check(config, device, repeats=2 if args.dry_run else 3))
        precisions = ["bf16", "fp8-emulated"] if args.dry_run else ["bf16", "fp8"]
        shape = (8, 24, 2, 2) if args.dry_run else (64, 448, 4, 4)
        report["learner"] = learner_check(config, device, precisions, steps=2 if args.dry_run else 4, shape=shape)
    except Exception as error:  # noqa: BLE001 -- reported with what was measured before it
        report["error"] = f"{type(error).__name__}: {error}"
        status = 1
    finally:
        signal.alarm(0)
    report["seconds"] = time.perf_counter() - started
    print(json.dumps(report, indent=2))
    return status


if __name__ == "__main__":
    sys.exit(main())
