"""Full fine-tuning against LoRA on one machine, in one run; prints JSON.

1. Policy server (each of `--backends`, SmolLM2-135M from its package, float32): the median time of
   a whole push of the full weights against a push of a LoRA adapter (rank `--rank` on the
   attention projections), both with per-tensor digests as the learner sends them and up to the
   moment UpdateWeights returns (the adapter serving); and generation tokens/s of the same Generate
   (n = 16, 64 tokens, sampled) on the base weights and with the adapter, interleaved.
2. Learner (a child process per mode, so that peak RSS is each mode's own): the median optimizer
   step time of GRPO on the same synthetic batch, trainable parameters, the tensors a push carries,
   and the process's peak RSS.
3. With `--gain-seconds S`: `bench/real_model.py --seconds S` for each mode (`--set learner.lora...`
   for LoRA: an adapter on `--gain-targets` at `--lora-lr`; one base evaluation for both, or
   `--base-report`), and each run's held-out gain with its interval, its steps and groups generated.

Output: {"policy": {backend: {"full_push_s", "lora_push_s", "push_ratio_lora_over_full",
         "base_tokens_per_s", "lora_tokens_per_s", "tokens_ratio_lora_over_base"}},
         "learner": {"full": {...}, "lora": {...}, "step_ratio_lora_over_full", "rss_ratio_lora_over_full"},
         "gain": {...} (with --gain-seconds)}
Usage: python bench/lora.py [--backends transformers vllm] [--rank 8] [--repeats 3] [--gain-seconds 0]
       [--base-report FILE] [--gain-modes full lora] [--lora-lr 1e-4] [--gain-targets q_proj ...]
       [--parts [policy] [learner]] [--output FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from sciproto.processes import lifeline_popen_options, watch_parent

MODEL = "smollm2"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
PROMPT = "Maria has 14 apples and buys 7 more. How many apples does she have now? Reply with the number only."
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def progress(message: str) -> None:
    print(f"[lora bench] {message}", file=sys.stderr, flush=True)


def spec_of(rank: int) -> Any:
    from sciproto.lora import LoraSpec

    return LoraSpec(name="bench", rank=rank, alpha=2.0 * rank, target_modules=TARGETS)


def adapter_tensors(model: Any, spec: Any) -> dict[str, Any]:
    """Random A and B (non-zero B, so the adapter changes what is sampled) of `spec` for `model`."""
    import torch

    from sciproto.lora import adapter_tensor_specs, linear_layers

    generator = torch.Generator().manual_seed(0)
    return {s.name: torch.randn(s.shape, generator=generator) * 0.02
            for s in adapter_tensor_specs(linear_layers(model), spec, "float32")}


# -- 1. policy server ---------------------------------------------------------------------------


async def sampled_tokens(client: Any, adapter: str, seed: int) -> tuple[float, int]:
    from sciproto.client.policy import generate_request
    from sciproto.pb import common_pb2

    request = generate_request(messages=[common_pb2.ChatMessage(role=common_pb2.ROLE_USER, content=PROMPT)],
                               temperature=0.7, max_tokens=64, n=16, seed=seed, adapter=adapter)
    start = time.perf_counter()
    group = await client.generate_group(request, timeout_s=600)
    return time.perf_counter() - start, sum(len(s.completion_token_ids) for s in group.samples)


async def bench_server(target: str, full: dict[str, Any], adapter: dict[str, Any], spec: Any,
                       repeats: int) -> dict[str, Any]:
    from sciproto.client.policy import PolicyClient
    from sciproto.weights.wire import tensor_digests

    full_digests = tensor_digests(full)
    adapter_digests = tensor_digests(adapter)
    full_s, lora_s, base_rate, lora_rate = [], [], [], []
    async with PolicyClient(target) as client:
        version = (await client.describe()).policy_version
        for round_ in range(repeats):
            version += 1
            # The adapter first: pushed right after the 651 MB of a full push, it took about three
            # times as long in the first runs (a cost of the push before it, not profiled).
            start = time.perf_counter()
            await client.push_weights(adapter, version, digests=adapter_digests, adapter=spec.to_proto())
            lora_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            await client.push_weights(full, version, digests=full_digests)
            full_s.append(time.perf_counter() - start)
            for name, rates in (("", base_rate), (spec.name, lora_rate)):
                seconds, tokens = await sampled_tokens(client, name, seed=round_)
                rates.append(tokens / seconds)
            progress(f"round {round_ + 1}/{repeats}: full push {full_s[-1]:.3f} s, adapter push {lora_s[-1] * 1e3:.1f} ms, "
                     f"base {base_rate[-1]:.0f} tok/s, adapter {lora_rate[-1]:.0f} tok/s")
    return {"full_push_s": statistics.median(full_s), "lora_push_s": statistics.median(lora_s),
            "push_ratio_lora_over_full": round(statistics.median(lora_s) / statistics.median(full_s), 5),
            "base_tokens_per_s": round(statistics.median(base_rate), 1),
            "lora_tokens_per_s": round(statistics.median(lora_rate), 1),
            "tokens_ratio_lora_over_base": round(statistics.median(lora_rate) / statistics.median(base_rate), 3),
            "full_push_bytes": sum(t.numel() * t.element_size() for t in full.values()),
            "lora_push_bytes": sum(t.numel() * t.element_size() for t in adapter.values())}


def bench_policy(backends: list[str], rank: int, repeats: int) -> dict[str, Any]:
    import torch

    from sciproto.client.policy import distinct_tensors
    from sciproto.models import load_model
    from sciproto.processes import start_server

    spec = spec_of(rank)
    loaded = load_model(MODEL, dtype=torch.float32, seed=0)
    full = distinct_tensors(dict(loaded.model.state_dict()))
    adapter = adapter_tensors(loaded.model, spec)
    results = {}
    for backend in backends:
        progress(f"starting a {backend} policy server ({MODEL})")
        env = {**os.environ, **VLLM_ENV} if backend == "vllm" else None
        # One adapter of this rank: vLLM's CPU kernels cost every request by the largest rank taken.
        server = start_server(["serve", "policy", "--port", "0", "--model", MODEL, "--set", f"backend={backend}",
                               "--set", "adapters.max_adapters=1", "--set", f"adapters.max_rank={rank}"],
                              timeout_s=900, env=env)
        try:
            results[backend] = asyncio.run(bench_server(server.target, full, adapter, spec, repeats))
        finally:
            server.stop()
    return results


# -- 2. learner ---------------------------------------------------------------------------------


def synthetic_batch(vocab: int, groups: int, samples: int, prompt: int, completion: int) -> list[Any]:
    """GRPO groups of random tokens with rewards that differ inside each group (every group trains),
    the same for both modes: the step's cost, not what it learns, is measured."""
    import random

    from learner.types import RolloutGroup, TrainSample

    rng = random.Random(0)
    batch = []
    for g in range(groups):
        shared = [rng.randrange(1000, vocab) for _ in range(prompt)]
        batch.append(RolloutGroup(group_id=f"g{g}", task="bench", samples=[TrainSample(
            token_ids=shared + [rng.randrange(1000, vocab) for _ in range(completion)],
            loss_mask=[0] * prompt + [1] * completion,
            rollout_logprobs=[0.0] * prompt + [-2.0] * completion,
            policy_versions=[-1] * prompt + [0] * completion,
            reward=float(i % 2), sample_index=i) for i in range(samples)]))
    return batch


def learner_child(mode: str, rank: int, steps: int) -> dict[str, Any]:
    """One mode's GRPO steps in this process (a child: its peak RSS is its own)."""
    import torch

    from learner.config import GRPOConfig
    from learner.trainer import GRPOTrainer
    from sciproto.models import load_model

    loaded = load_model(MODEL, dtype=torch.float32, seed=0)
    loaded.model.requires_grad_(True)  # load_model hands out an inference-only model, as the learner app knows
    spec = spec_of(rank) if mode == "lora" else None
    trainer = GRPOTrainer(loaded.model, GRPOConfig(lr=1e-5, max_staleness=4), lora=spec, model_name=MODEL)
    batch = synthetic_batch(len(loaded.tokenizer), groups=2, samples=4, prompt=48, completion=32)
    times, push_s = [], []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.train_step(batch)
        times.append(time.perf_counter() - start)
        start = time.perf_counter()
        pushed = trainer.state_dict_for_push()
        push_s.append(time.perf_counter() - start)
        trainer.policy_version = 0  # the same batch stays current
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    return {"step_s": statistics.median(times[1:] or times), "step_s_each": [round(t, 3) for t in times],
            "state_dict_for_push_s": statistics.median(push_s[1:] or push_s),
            "trainable_parameters": trainable, "pushed_tensors": len(pushed),
            "pushed_bytes": sum(t.numel() * t.element_size() for t in pushed.values()),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def bench_learner(rank: int, steps: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for mode in ("full", "lora"):
        progress(f"learner: {steps} GRPO steps, {mode}")
        done = subprocess.run([sys.executable, __file__, "--learner-child", mode, "--rank", str(rank),
                               "--steps", str(steps)], capture_output=True, text=True, timeout=3600, check=False,
                              **lifeline_popen_options())
        if done.returncode != 0:
            raise SystemExit(f"the {mode} learner child failed:\n{done.stderr[-3000:]}")
        results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    results["step_ratio_lora_over_full"] = round(results["lora"]["step_s"] / results["full"]["step_s"], 3)
    results["rss_ratio_lora_over_full"] = round(results["lora"]["peak_rss_bytes"] / results["full"]["peak_rss_bytes"], 3)
    return results


# -- 3. held-out gain ---------------------------------------------------------------------------


def bench_gain(seconds: float, rank: int, output: Path, base_report: Path | None, modes: list[str],
               lora_lr: float, targets: list[str]) -> dict[str, Any]:
    """Each mode trained `seconds` by bench/real_model.py and evaluated on the same held-out tasks; the
    base model is evaluated once (or read from `base_report`) and reused by every mode. LoRA trains an
    adapter on `targets` at `lora_lr` (an adapter wants a rate well above full fine-tuning's)."""
    runs = {"full": [], "lora": ["--set", f"learner.lora.rank={rank}", "--set", f"learner.lora.alpha={2 * rank}",
                                 "--set", f"learner.lora.target_modules=[{','.join(targets)}]",
                                 "--set", f"learner.grpo.lr={lora_lr:g}"]}
    runs_dir = Path("runs")
    results: dict[str, Any] = {"seconds": seconds, "lora_lr": lora_lr, "lora_targets": targets}
    for mode, extra in ((mode, runs[mode]) for mode in modes):
        out = output.with_name(f"{output.stem}.gain-{mode}.json")
        run_name = f"bench-lora-gain-{mode}-{int(time.time())}"
        progress(f"held-out gain, {mode}: bench/real_model.py --seconds {seconds:g} (run {runs_dir / run_name})")
        base = ["--base-report", str(base_report)] if base_report else []
        subprocess.run([sys.executable, str(Path(__file__).with_name("real_model.py")), "--seconds", str(seconds),
                        "--runs-dir", str(runs_dir), "--run-name", run_name, "--output", str(out), "--curve-every", "0",
                        *base, *extra],
                       check=True, timeout=seconds * 3 + 3600, **lifeline_popen_options())
        base_report = base_report or runs_dir / f"{run_name}.base-eval.json"
        report = json.loads(out.read_text())
        results[mode] = {"base": report["base"]["pass@1"], "trained": report["trained"]["pass@1"],
                         "trained_interval": [report["trained"]["low"], report["trained"]["high"]],
                         "gain_points": report["gain_points"], "steps": report["train"].get("steps"),
                         "groups_generated": report["train"].get("groups_generated"),
                         "gain_points_per_100_groups": report.get("gain_points_per_100_groups")}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", nargs="+", default=["transformers", "vllm"], choices=["transformers", "vllm"])
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="learner optimizer steps per mode (the first is warm-up)")
    parser.add_argument("--gain-seconds", type=float, default=0.0,
                        help="train each mode this long with bench/real_model.py and compare held-out gains (0: skip)")
    parser.add_argument("--base-report", type=Path, default=None,
                        help="with --gain-seconds: reuse this base evaluation (bench/real_model.py's *.base-eval.json)")
    parser.add_argument("--gain-modes", nargs="+", default=["full", "lora"], choices=["full", "lora"],
                        help="with --gain-seconds: the modes to train")
    parser.add_argument("--lora-lr", type=float, default=1e-4,
                        help="with --gain-seconds: LoRA's learning rate (10x arith_smollm2_cpu's 1e-5 for full weights)")
    parser.add_argument("--gain-targets", nargs="+", default=list(TARGETS),
                        help="with --gain-seconds: the linear layers LoRA's adapter wraps (default q/k/v/o)")
    parser.add_argument("--parts", nargs="*", default=["policy", "learner"], choices=["policy", "learner"])
    parser.add_argument("--output", type=Path, default=Path("bench/results/lora.json"))
    parser.add_argument("--learner-child", choices=["full", "lora"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.learner_child:
        watch_parent()  # stop when the bench that started this child is gone
        print(json.dumps(learner_child(args.learner_child, args.rank, args.steps)))
        return
    result: dict[str, Any] = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                              "model": MODEL, "rank": args.rank, "target_modules": list(TARGETS)}
    if "policy" in args.parts:
        result["policy"] = bench_policy(args.backends, args.rank, args.repeats)
    if "learner" in args.parts:
        result["learner"] = bench_learner(args.rank, args.steps)
    if args.gain_seconds > 0:
        result["gain"] = bench_gain(args.gain_seconds, args.rank, args.output, args.base_report, args.gain_modes,
                                    args.lora_lr, args.gain_targets)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
