"""GRPO training step with the group's shared prompt run once, and its rows' padding skipped, vs
every sequence in full; prints JSON.

Workload shaped like agent RL on GSM8K: G groups of S samples, each group sharing a prompt (system
prompt, tool specs, question) followed by completions of different lengths (uniform in
--completion MIN MAX). The same trainer code runs three ways, alternating in this process from the
same starting weights:
  - full:     `shared_prefix_min_tokens` 0, `skip_padding` off: every sequence in full, padded;
  - shared:   the prompt once (16), the rows after it padded to the longest;
  - unpadded: the prompt once, the rows after it packed into one row without padding (the
              default, learner/prefix.py).
With `--precision fp32 bf16` each mode also runs under bf16 autocast over the same fp32 weights
(learner/precision.py; on a CPU with AMX the bf16 matmuls are the fast ones); `--modes` runs only
some modes. Each figure is the median of the timed steps after one warm-up step. Also reports the
loss of the first step of each, which must agree (to bf16's rounding across precisions).
Output: {"full": {...}, "shared": {...}, "unpadded": {...}, "unpadded-bf16": {...},
         "speedup_shared_over_full": ..., "speedup_unpadded_over_shared": ...,
         "speedup_bf16_over_fp32": {mode: ...}}.
Usage: python bench/shared_prefix.py [--prompt 600] [--completion 60 200] [--groups 2] [--samples 8]
       [--steps 3] [--model tiny|smollm2] [--micro-batch-tokens 4096] [--threads N]
       [--modes full shared unpadded] [--precision fp32 [bf16]]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from learner.config import GRPOConfig
from learner.trainer import GRPOTrainer
from learner.types import RolloutGroup, TrainSample
from sciproto.models import load_model

MODES = {"full": (0, False), "shared": (16, False), "unpadded": (16, True)}  # (shared_prefix_min_tokens, skip_padding)


def groups_with_shared_prompts(vocab: int, prompt: int, groups: int, samples: int, seed: int = 0,
                               completion: tuple[int, int] = (60, 200)) -> list[RolloutGroup]:
    rng = random.Random(seed)
    made = []
    for group in range(groups):
        shared = [rng.randrange(vocab) for _ in range(prompt)]
        members = []
        for index in range(samples):
            length = rng.randint(*completion)
            members.append(TrainSample(
                token_ids=shared + [rng.randrange(vocab) for _ in range(length)],
                loss_mask=[0] * prompt + [1] * length,
                rollout_logprobs=[0.0] * prompt + [-2.0] * length,
                policy_versions=[-1] * prompt + [0] * length,
                reward=float(index % 2), sample_index=index,
            ))
        made.append(RolloutGroup(group_id=f"g{group}", task="bench", samples=members))
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=600, help="shared prompt tokens per group")
    parser.add_argument("--completion", type=int, nargs=2, default=(60, 200), metavar=("MIN", "MAX"),
                        help="completion tokens per sample, uniform in [MIN, MAX]")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode, after one warm-up")
    parser.add_argument("--model", default="tiny", help="a policy_server model name (tiny, smollm2)")
    parser.add_argument("--micro-batch-tokens", type=int, default=GRPOConfig().micro_batch_tokens)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--precision", nargs="+", choices=["fp32", "bf16"], default=["fp32"],
                        help="learner.grpo.precision of each mode (bf16: autocast over fp32 weights)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    runs = {(mode if precision == "fp32" else f"{mode}-{precision}"): (mode, precision)
            for precision in args.precision for mode in args.modes}
    loaded = {name: load_model(args.model, seed=0) for name in runs}  # same weights
    batch = groups_with_shared_prompts(len(next(iter(loaded.values())).tokenizer), args.prompt, args.groups,
                                       args.samples, completion=tuple(args.completion))
    # A negligible lr keeps the weights, so every step of every mode does the same work.
    trainers = {
        name: GRPOTrainer(loaded[name].model.requires_grad_(True),
                          GRPOConfig(shared_prefix_min_tokens=MODES[mode][0], skip_padding=MODES[mode][1], lr=1e-12,
                                     micro_batch_tokens=args.micro_batch_tokens, precision=precision))
        for name, (mode, precision) in runs.items()
    }
    times: dict[str, list[float]] = {mode: [] for mode in trainers}
    first_loss: dict[str, float] = {}
    for step in range(args.steps + 1):
        for mode, trainer in trainers.items():
            began = time.perf_counter()
            metrics = trainer.train_step(batch)
            elapsed = time.perf_counter() - began
            first_loss.setdefault(mode, metrics.loss)
            if step > 0:  # the first step warms up allocators and kernels
                times[mode].append(elapsed)
    tokens = sum(len(s.token_ids) for g in batch for s in g.samples)
    result = {
        mode: {"seconds_per_step": round(statistics.median(seconds), 3),
               "tokens_per_s": round(tokens / statistics.median(seconds), 1),
               "first_step_loss": first_loss[mode]}
        for mode, seconds in times.items()
    }
    def speedup(slow: str, fast: str) -> float | None:
        if slow not in result or fast not in result:
            return None
        return round(result[slow]["seconds_per_step"] / result[fast]["seconds_per_step"], 2)

    result["speedup_shared_over_full"] = speedup("full", "shared")
    result["speedup_unpadded_over_shared"] = speedup("shared", "unpadded")
    if "bf16" in args.precision and "fp32" in args.precision:
        result["speedup_bf16_over_fp32"] = {mode: speedup(mode, f"{mode}-bf16") for mode in args.modes}
    result["workload"] = {"model": args.model, "prompt_tokens": args.prompt, "completion_tokens": list(args.completion),
                          "groups": args.groups, "samples": args.samples, "tokens_per_step": tokens,
                          "threads": torch.get_num_threads()}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
