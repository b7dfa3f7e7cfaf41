"""FP8 vs BF16 GRPO training steps on a Hopper-class GPU; prints JSON with the speed ratio.

Builds a ~0.5B-parameter Qwen2-style model from a config (random weights, nothing downloaded),
then for each precision:
  - step time of `GRPOTrainer.train_step` on a fixed synthetic batch (median of timed steps after
    warm-up, which includes torch.compile of the decoder layers);
  - logprob mismatch against an FP32 forward of the same weights on the same tokens:
    mean over tokens of exp|log p - log p_fp32| (1.0 = identical), the learner's mismatch metric.
Output: {"bf16": {...}, "fp8": {...}, "speedup_fp8_over_bf16": ..., ...}.
Needs CUDA with compute capability >= 8.9; elsewhere it exits with status 2 and says so.
Usage: python bench/fp8_train.py [--steps 5] [--warmup 3] [--no-compile]
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import sys
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from learner.config import GRPOConfig
from learner.fp8 import FP8UnavailableError, count_fp8_linears, require_fp8_hardware
from learner.trainer import GRPOTrainer
from learner.types import RolloutGroup, TrainSample

# All linear dims are multiples of 16 (FP8 matmul requirement); ~0.51B parameters with tied
# embeddings: 24 x (2.6M attention + 17.3M MLP) + 33.5M embedding.
MODEL_CONFIG = {
    "vocab_size": 32768,
    "hidden_size": 1024,
    "intermediate_size": 5632,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}
PROMPT_TOKENS = 64
COMPLETION_TOKENS = 448
GROUPS = 4
SAMPLES_PER_GROUP = 4


def build_model(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(**MODEL_CONFIG)
    return Qwen2ForCausalLM(config).float().cuda()


def synthetic_groups(seed: int = 0) -> list[RolloutGroup]:
    """Fixed-length samples (no recompiles) with rewards that differ inside every group."""
    rng = random.Random(seed)
    length = PROMPT_TOKENS + COMPLETION_TOKENS
    mask = [0] * PROMPT_TOKENS + [1] * COMPLETION_TOKENS
    vocab = MODEL_CONFIG["vocab_size"]
    return [
        RolloutGroup(
            group_id=str(g),
            task="bench",
            samples=[
                TrainSample(
                    token_ids=[rng.randrange(vocab) for _ in range(length)],
                    loss_mask=mask,
                    rollout_logprobs=[-10.4 * m for m in mask],
                    policy_versions=[0 if m else -1 for m in mask],
                    reward=float(i % 2),
                    sample_index=i,
                )
                for i in range(SAMPLES_PER_GROUP)
            ],
        )
        for g in range(GROUPS)
    ]


def token_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]


def make_trainer(fp32_model: torch.nn.Module, precision: str, compile_layers: bool) -> GRPOTrainer:
    config = GRPOConfig(
        precision=precision,
        lr=1e-5,
        micro_batch_tokens=GROUPS * SAMPLES_PER_GROUP * (PROMPT_TOKENS + COMPLETION_TOKENS),
    )
    trainer = GRPOTrainer(copy.deepcopy(fp32_model), config)
    if compile_layers:
        # Compiling each decoder layer in place keeps parameter names (no _orig_mod prefix) and
        # fuses torchao's scaling and casting kernels, without which FP8 cannot be faster.
        for layer in trainer.model.model.layers:
            layer.compile()
    return trainer


def measure(
    fp32_model: torch.nn.Module,
    reference_logprobs: torch.Tensor,
    eval_ids: torch.Tensor,
    precision: str,
    args: argparse.Namespace,
) -> dict:
    trainer = make_trainer(fp32_model, precision, compile_layers=args.compile)
    # Mismatch first, while the weights still equal the FP32 reference's, in the trainer's compute
    # precision (its weights are fp32 masters; bf16 and FP8 are how its forward computes).
    with trainer.compute():
        logprobs = token_logprobs(trainer.model, eval_ids)
    mismatch = torch.exp((logprobs - reference_logprobs).abs()).mean().item()

    groups = synthetic_groups()
    times = []
    for step in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        metrics = trainer.train_step(groups)
        torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    result = {
        "step_s_median": step_s,
        "tokens_per_s": metrics.tokens / step_s,
        "mismatch_vs_fp32": mismatch,
        "final_loss": metrics.loss,
        "fp8_linears": count_fp8_linears(trainer.model),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
    }
    del trainer
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per precision")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (compile) first")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    try:
        require_fp8_hardware()
    except FP8UnavailableError as error:
        print(f"bench/fp8_train.py: {error}", file=sys.stderr)
        return 2

    fp32_model = build_model()
    params = sum(p.numel() for p in fp32_model.parameters())
    eval_ids = torch.tensor(
        [g.samples[0].token_ids for g in synthetic_groups(seed=1)], device="cuda"
    )
    reference_logprobs = token_logprobs(fp32_model, eval_ids)

    results = {
        p: measure(fp32_model, reference_logprobs, eval_ids, p, args) for p in ("bf16", "fp8")
    }
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "params": params,
        "tokens_per_step": GROUPS * SAMPLES_PER_GROUP * COMPLETION_TOKENS,
        "compiled": args.compile,
        **results,
        "speedup_fp8_over_bf16": results["bf16"]["step_s_median"] / results["fp8"]["step_s_median"],
        "mismatch_fp8_over_bf16": (results["fp8"]["mismatch_vs_fp32"] - 1)
        / max(results["bf16"]["mismatch_vs_fp32"] - 1, 1e-12),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
