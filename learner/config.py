"""Settings of the GRPO learner: loss, staleness, optimizer, batching."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from sciproto.sampling import SAMPLING_DEFAULTS


class GRPOConfig(BaseModel):
    """Every knob of one GRPO training step. Defaults suit small models learning toy tasks."""

    model_config = ConfigDict(extra="forbid")

    # 3e-3 takes a tiny random byte-level model from ~0.05 to >0.9 mean reward on the
    # "digits only" toy task in ~25 steps of 16 groups x 8 samples; pretrained LLMs want ~1e-6.
    lr: float = Field(default=3e-3, gt=0)
    # Learning rate of the steps on SFT groups (learner/sft.py; None: lr). Demonstrations of a
    # pretrained model want ~1e-5 where its GRPO steps want ~1e-6.
    sft_lr: float | None = Field(default=None, gt=0)
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay")
    adam_betas: tuple[float, float] = Field(default=(0.9, 0.99), description="AdamW betas")
    # PPO-style asymmetric clip ("clip higher"): rho is clipped to [1 - eps_low, 1 + eps_high].
    eps_low: float = Field(default=0.2, ge=0, lt=1)
    eps_high: float = Field(default=0.28, ge=0)
    # Added to the group reward std so that near-equal rewards do not explode the advantages.
    adv_eps: float = Field(default=1e-6, gt=0)
    # Importance weight pi_old/mu against the rollout policy: truncated at is_cap ("truncate"),
    # tokens above the cap dropped ("mask"), or ignored ("off").
    is_cap: float = Field(default=2.0, gt=0)
    is_correction: Literal["truncate", "mask", "off"] = "truncate"
    # The temperature of trained tokens whose rollout does not say what sampled them (a sender
    # before protocol 1.3; Rollout.sampling_spans otherwise gives each turn's temperature, top_p and
    # top_k, and the learner trains each token under its own): pi_theta = softmax(logits /
    # temperature), the policy that sampled them, so pi_old / mu is 1 for the weights that
    # generated. `sciproto train` sets it from rollout.sampling.temperature.
    temperature: float = Field(default=SAMPLING_DEFAULTS.temperature, gt=0)
    # Optimizer steps per batch (PPO/DAPO mini-batches): pi_old is computed once for the whole
    # batch before the first step, then the batch is split in order into this many parts of about
    # equal trained tokens, one AdamW step each; rho = pi_theta / pi_old is 1 only in the first,
    # and the clip bounds the later ones. The policy version still grows by one per batch (one
    # push). 1: a single step, where the clip never fires.
    mini_batches: int = Field(default=1, ge=1)
    # Groups whose oldest trained token is more than this many versions old are dropped.
    max_staleness: int = Field(default=1, ge=0)
    # A prefix shared by every sequence of a micro-batch (the group's prompt) runs once when it
    # is at least this many tokens long; 0 runs every sequence in full. See learner/prefix.py.
    shared_prefix_min_tokens: int = Field(default=16, ge=0)
    # Run the rows of a micro-batch without their right padding, as one packed row with a
    # block-causal mask (learner/prefix.py), where that saves at least a tenth of its positions,
    # and skip the logits of an untrained shared prompt. Same loss and gradient up to float
    # rounding; transformers models under SDPA attention only (others run padded). Off: padded.
    skip_padding: bool = True
    # Upper bound of token positions in one forward/backward pass: sequences x padded length, with
    # a shared prefix (above) counted once.
    micro_batch_tokens: int = Field(default=4096, gt=0)
    max_grad_norm: float = Field(default=1.0, gt=0, description="Gradients are clipped to this global norm")
    # Reference KL penalty (k3 estimator); 0 keeps no reference model.
    kl_coef: float = Field(default=0.0, ge=0)
    # DAPO's overlong filtering: a sample with a policy turn cut by its token limit (finish reason
    # LENGTH) trains no token; its reward still counts in its group's mean and std. Off: such
    # samples train like any other (StepMetrics counts them either way).
    mask_truncated: bool = False
    # Train each assistant turn as its own sequence (long multi-turn episodes); same loss value.
    per_transition: bool = False
    seed: int = Field(default=0, description="Seed of torch's generator when the trainer starts")
    # fp8 needs a CUDA GPU with compute capability >= 8.9; fp8-emulated runs the FP8 numerics
    # on any device (tests). auto: bf16 where the learner's device multiplies bf16 natively (a CPU
    # with AMX, a GPU with compute capability >= 8.0), fp32 elsewhere; the learner resolves it when
    # it starts (sciproto.hardware).
    precision: Literal["auto", "fp32", "bf16", "fp8", "fp8-emulated"] = "fp32"
