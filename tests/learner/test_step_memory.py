"""A training step's memory: its peak is reported, and what it freed goes back to the OS, so a
long run's resident memory does not creep up from step to step (a 60-minute SmolLM2 run was
killed at 21 GB). Measured in a fresh process, on a real model and real groups: a 49152-token
vocabulary (SmolLM2's) and 4096-position micro-batches, the shapes of the tool-use runs."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

STEPS = textwrap.dedent("""
    import json, random, torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from learner.config import GRPOConfig
    from learner.memory import resident_gb
    from learner.trainer import GRPOTrainer
    from learner.types import RolloutGroup, TrainSample

    def groups(seed):
        rng = random.Random(seed)
        system = [rng.randrange(100, 49000) for _ in range(300)]
        out = []
        for g in range(4):
            prompt = system + [rng.randrange(100, 49000) for _ in range(80)]
            samples = []
            for s in range(6):
                completion = [rng.randrange(100, 49000) for _ in range(rng.randrange(100, 340))]
                mask = [0] * len(prompt) + [1] * len(completion)
                samples.append(TrainSample(token_ids=prompt + completion, loss_mask=mask, reward=float(s % 2),
                                           rollout_logprobs=[-1.0 * m for m in mask], policy_versions=[0] * len(mask),
                                           sample_index=s))
            out.append(RolloutGroup(group_id=f"{seed}-{g}", task="t", samples=samples))
        return out

    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True)).train()
    trainer = GRPOTrainer(model, GRPOConfig(lr=1e-5, micro_batch_tokens=4096), pad_token_id=0)
    parameters_gb = sum(p.numel() for p in model.parameters()) * 4 / 1e9
    before = resident_gb()
    steps = [trainer.train_step(groups(seed)) for seed in range(2)]
    print(json.dumps({"before": before, "after": resident_gb(), "parameters_gb": parameters_gb,
                      "peaks": [getattr(step, "peak_rss_gb", None) for step in steps],
                      "gpu": [getattr(step, "peak_gpu_gb", None) for step in steps]}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads resident memory from /proc")
def test_a_step_gives_its_memory_back_and_reports_its_peak() -> None:
    result = subprocess.run([sys.executable, "-c", STEPS], capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    retained = measured["after"] - measured["before"]
    # Kept for good after the first step: gradients and AdamW's two moments, 3x the parameters
    # (float32), and some room for the allocator's own bookkeeping.
    assert retained < 3 * measured["parameters_gb"] + 0.2, measured
    peaks = measured["peaks"]
    assert all(peak is not None and peak > measured["before"] for peak in peaks), measured
    assert measured["gpu"] == [None, None]
