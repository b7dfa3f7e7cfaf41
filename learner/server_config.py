"""Configuration of a learner process (`sciproto serve learner`)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from learner.config import GRPOConfig
from learner.lora_limits import refusal
from sciproto.auth import AuthConfig
from sciproto.channel import ServerAccess
from sciproto.lora import LoraSpec
from sciproto.server import ServerConfig
from sciproto.tracing import TracingConfig


class MetricsConfig(BaseModel):
    """Where step metrics go besides `metrics.jsonl` (always written)."""

    model_config = ConfigDict(extra="forbid")

    backend: Literal["none", "tensorboard", "wandb"] = Field(
        "none", description="Also log to TensorBoard or Weights & Biases (needs the package)"
    )
    wandb_project: str = Field("sciproto", description="Weights & Biases project")
    plot_every: int = Field(10, ge=1, description="Redraw the PNG plot every this many steps")


class FaultInjection(BaseModel):
    """Test hooks that make the learner fail on purpose, to exercise its recovery paths.

    Empty in any real run; the tests set them through the config like any other key.
    """

    model_config = ConfigDict(extra="forbid")

    fail_step_attempts: list[int] = Field(
        default_factory=list,
        description=(
            "Optimizer step attempts (counted from 1 in this process) that fail with an injected "
            "error before training; their groups go back to the buffer like any failed step's"
        ),
    )
    hold_at: Literal["after_train", "after_metrics", "in_checkpoint", "after_checkpoint"] | None = (
        Field(
            None,
            description=(
                "Stop making progress (the process stays up, for a test to SIGKILL it) at this "
                "point of optimizer step `hold_step`: after the trainer stepped, after the metrics "
                "line, between the checkpoint's trainer files and its learner_state.json, or after "
                "the whole checkpoint. The learner logs 'holding at <point> of step <n>' first"
            ),
        )
    )
    hold_step: int = Field(
        1, ge=1, description="The optimizer step `hold_at` and `micro_batch_delay_s` apply to"
    )
    micro_batch_delay_s: float = Field(
        0.0,
        ge=0,
        description=(
            "Wait this long before each micro-batch of step `hold_step`, as a slow model would: a "
            "step that outlasts `stop_step_wait_s`, which a stop then interrupts"
        ),
    )
    hold_s: float | None = Field(
        None,
        gt=0,
        description=(
            "Hold at `hold_at` this many seconds, then go on (None: until killed): a step still "
            "in flight when a run is stopped"
        ),
    )


class LearnerServerConfig(BaseModel):
    """Everything a learner process needs; `sciproto serve learner --set key=value` edits it."""

    model_config = ConfigDict(extra="forbid")

    server: ServerConfig = Field(default_factory=ServerConfig)
    # The learner builds the same model as the policy servers: same spec and seed.
    model: str = Field(
        "tiny", description='"tiny", "smollm2", or a local Hugging Face model directory'
    )
    model_seed: int = Field(
        0, description="Seed of the random `tiny` model's weights (the policy server's `seed`)"
    )
    device: str = Field("cpu", description='Torch device of training, e.g. "cpu" or "cuda:0"')
    torch_threads: int = Field(
        0, ge=0, description="CPU threads torch may use (0: torch's default)"
    )
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    lora: LoraSpec | None = Field(
        None,
        description=(
            "Train this LoRA adapter on the frozen base model and push only it (`--set lora.rank=8`; unset: "
            "train and push the full weights). One learner rank, precision fp32 or bf16, "
            "push_transport grpc"
        ),
    )
    batch_groups: int = Field(16, ge=1, description="Groups per optimizer step")
    buffer_capacity: int = Field(
        64, ge=1, description="Most groups buffered; TrainStep stops reading beyond it"
    )
    add_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Longest a group waits for a buffer slot before its receipt says 'busy'",
    )
    take_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Longest wait for a batch before the optimizer loop reports it and waits again",
    )
    policy_targets: list[str] = Field(
        default_factory=list,
        description="HOST:PORT of every policy server that receives new weights",
    )
    push_every: int = Field(1, ge=1, description="Push weights every this many optimizer steps")
    hold_policy: bool = Field(
        False,
        description=(
            "Hold the policy servers' generation (PolicyService.Hold) from the start of each optimizer step until "
            "its push has ended, so the step has every core: colocated placement, where policy and learner share "
            "one machine (learner.policy_hold)"
        ),
    )
    push_timeout_s: float = Field(
        300.0, gt=0, description="Longest a weight push to one server may take"
    )
    push_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="dtype of the pushed weights (the trainer keeps fp32 masters): auto asks each "
        "policy server (Describe) which dtype it serves; they must agree",
    )
    reconcile_interval_s: float = Field(
        5.0,
        gt=0,
        description=(
            "Ask every policy server its version this often (and at once when a group arrives "
            "stale) and re-push the current weights to any server behind the last push"
        ),
    )
    max_step_attempts: int = Field(
        3,
        ge=1,
        description=(
            "Optimizer steps a group may fail in a row before it is given up (named as abandoned)"
        ),
    )
    faults: FaultInjection = Field(default_factory=FaultInjection)
    push_transport: Literal["grpc", "nccl", "gloo"] = Field(
        "grpc",
        description="grpc: UpdateWeights chunks; nccl: vLLM weight transfer (learner.vllm_sync); "
        "gloo: the same over a CPU gloo group (learner.collective_push)",
    )
    collective: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "Rendezvous of the collective weight transfer (push_transport nccl or gloo): "
            "master_address, master_port, world_size, timeout_s; read from `nccl:`, its name "
            "before, with a warning"
        ),
    )
    run_dir: Path = Field(
        Path("runs/learner"), description="Checkpoints and metrics go here; resumed from"
    )
    max_steps: int | None = Field(
        None,
        ge=1,
        description=(
            "Train no further than this optimizer step (groups still get receipts); `sciproto"
            " train` sets it from budget.max_steps, so a step in flight at the budget is not extra"
        ),
    )
    checkpoint_every: int = Field(
        0,
        ge=0,
        description="Save a checkpoint every this many steps (0: only on request and at shutdown)",
    )
    stop_step_wait_s: float = Field(
        60.0,
        ge=0,
        description=(
            "On SIGTERM, how long the step in flight may run on before it is interrupted at its "
            "next micro-batch (its groups stay untrained; the final checkpoint is of the step "
            "before). `sciproto train` sets half of processes.stop_timeout_s, leaving the other "
            "half for the checkpoint"
        ),
    )
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    policy_access: ServerAccess = Field(
        default_factory=ServerAccess,
        description="Token (with the trainer role) and TLS for pushing weights to the policy servers",
    )
    auth: AuthConfig = Field(default_factory=AuthConfig, description="Who may call this learner")
    tracing: TracingConfig = Field(default_factory=TracingConfig)

    @model_validator(mode="before")
    @classmethod
    def _nccl_is_collective(cls, data: Any) -> Any:
        """`nccl:` is the deprecated name of `collective:` (it configures gloo transfers too),
        read for one more release."""
        if not isinstance(data, dict) or "nccl" not in data:
            return data
        if "collective" in data:
            raise ValueError("both `collective` and `nccl` are set; keep `collective` (`nccl` is its old name)")
        warnings.warn("the learner's `nccl:` section is now `collective:` (it configures gloo transfers too); "
                      "rename it: the old name is read until the next release", FutureWarning, stacklevel=2)
        data = dict(data)
        data["collective"] = data.pop("nccl")
        return data

    @model_validator(mode="after")
    def _buffer_holds_a_batch(self) -> LearnerServerConfig:
        if self.buffer_capacity < self.batch_groups:
            raise ValueError(
                f"buffer_capacity ({self.buffer_capacity}) must hold at least one batch "
                f"(batch_groups = {self.batch_groups})"
            )
        if self.push_every > self.grpo.max_staleness + 1:
            raise ValueError(
                f"push_every ({self.push_every}) > max_staleness + 1 "
                f"({self.grpo.max_staleness + 1}): the policy servers serve the last pushed "
                "version until the next push, and their groups turn stale once the learner is "
                "more than max_staleness versions past it; after max_staleness + 1 steps without "
                "a push every new group would be refused and no step could run. Set push_every "
                "<= max_staleness + 1"
            )
        reason = refusal(self.lora, precision=self.grpo.precision, push_transport=self.push_transport)
        if reason is not None:
            raise ValueError(reason)
        return self
