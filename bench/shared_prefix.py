"""GRPO training step with the group's shared prompt run once vs every sequence in full; prints JSON.

Workload shaped like agent RL on GSM8K: G groups of S samples, each group sharing a long prompt
(system prompt, tool specs, question) followed by completions of different lengths. The same
trainer code runs with `shared_prefix_min_tokens` 16 (shared) and 0 (baseline, every sequence in
full), alternating in this process from the same starting weights; each figure is the median of
the timed steps after one warm-up step. Also reports the loss of the first step of each, which
must agree.
Output: {"full": {...}, "shared": {...}, "speedup_shared_over_full": ...}.
Usage: python bench/shared_prefix.py [--prompt 600] [--groups 2] [--samples 8] [--steps 3]
       [--model tiny|smollm2] [--micro-batch-tokens 4096]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from learner.config import GRPOConfig
from learner.trainer import GRPOTrainer
from learner.types import RolloutGroup, TrainSample
from sciproto.models import load_model


def groups_with_shared_prompts(vocab: int, prompt: int, groups: int, samples: int, seed: int = 0) -> list[RolloutGroup]:
    rng = random.Random(seed)
    made = []
    for group in range(groups):
        shared = [rng.randrange(vocab) for _ in range(prompt)]
        members = []
        for index in range(samples):
            completion = rng.randrange(60, 200)
            members.append(TrainSample(
                token_ids=shared + [rng.randrange(vocab) for _ in range(completion)],
                loss_mask=[0] * prompt + [1] * completion,
                rollout_logprobs=[0.0] * prompt + [-2.0] * completion,
                policy_versions=[-1] * prompt + [0] * completion,
                reward=float(index % 2), sample_index=index,
            ))
        made.append(RolloutGroup(group_id=f"g{group}", task="bench", samples=members))
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=600, help="shared prompt tokens per group")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode, after one warm-up")
    parser.add_argument("--model", default="tiny", help="a policy_server model name (tiny, smollm2)")
    parser.add_argument("--micro-batch-tokens", type=int, default=GRPOConfig().micro_batch_tokens)
    args = parser.parse_args()

    loaded = {mode: load_model(args.model, seed=0) for mode in ("full", "shared")}  # same weights
    batch = groups_with_shared_prompts(len(loaded["full"].tokenizer), args.prompt, args.groups, args.samples)
    # A negligible lr keeps the weights, so every step of both modes does the same work.
    trainers = {
        mode: GRPOTrainer(loaded[mode].model.requires_grad_(True), GRPOConfig(shared_prefix_min_tokens=minimum, lr=1e-12,
                                                         micro_batch_tokens=args.micro_batch_tokens))
        for mode, minimum in (("full", 0), ("shared", 16))
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
    result["speedup_shared_over_full"] = round(
        result["full"]["seconds_per_step"] / result["shared"]["seconds_per_step"], 2)
    result["workload"] = {"model": args.model, "prompt_tokens": args.prompt, "groups": args.groups,
                          "samples": args.samples, "tokens_per_step": tokens}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
