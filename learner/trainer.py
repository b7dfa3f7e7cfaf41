"""The GRPO update of one batch of rollout groups, read top to bottom in `grpo_step`."""

from __future__ import annotations

import contextlib
import copy
import math
import threading

import torch
import torch.distributed as dist
from pydantic import BaseModel
from torch import nn

from learner.config import GRPOConfig
from learner.distributed import all_reduce, current_context, full_state_dict, shard_model
from learner.grpo import (
    STAT_NAMES,
    MicroBatch,
    TrainSequence,
    grpo_loss,
    pad_right,
    prepare_batch,
    split_micro_batches,
    split_mini_batches,
)
from learner.lora import LoraWeights
from learner.lora_limits import refuse_unsupported
from learner.memory import StepMemory
from learner.precision import autocast, fsdp_policy, prepare_model
from learner.prefix import _logits_of, sequence_logprobs_and_entropy, usable_shared_prefix
from learner.sft import SFT_STAT_NAMES, sft_loss, sft_sequences
from learner.types import Objective, RolloutGroup
from sciproto.lora import LoraSpec

__all__ = ["GRPOConfig", "GRPOTrainer", "StepMetrics"]


class StepMetrics(BaseModel):
    """What one `train_step` did (one batch, `optimizer_steps` steps, one policy version). Token
    metrics are means over the batch's trained tokens."""

    step: int
    policy_version: int
    # False when no group carried signal: no optimizer step, no new policy version.
    trained: bool
    # What the batch trained: "grpo", or "sft" (learner/sft.py: then sft_loss and
    # sft_token_accuracy are set, `loss` is sft_loss, and the GRPO statistics stay 0).
    objective: str = "grpo"
    sft_loss: float | None = None
    sft_token_accuracy: float | None = None
    loss: float = 0.0
    kl: float = 0.0
    entropy: float = 0.0
    clip_frac_low: float = 0.0
    clip_frac_high: float = 0.0
    # Of the raw ratio pi_old/mu before truncation; is_frac_truncated: share of tokens over is_cap.
    is_weight_mean: float = 0.0
    is_weight_max: float = 0.0
    is_frac_truncated: float = 0.0
    # mean exp|log pi_old - log mu| over the trained tokens (pi_old: the learner's weights before
    # this batch): 1.0 when the learner and the policy servers agree exactly. It mixes two things,
    # reported apart: mismatch_engine over the tokens sampled whole at the learner's current
    # version (the same weights on both sides, so only the engines differ: kernels, dtype,
    # sampling), and staleness_shift over the others: tokens sampled by older versions, and those
    # of a turn that an update reached mid-way, drawn by the new weights over the KV cache of the
    # old ones (learner.grpo.whole_versions) (the updates since then, and the engine). None when the batch has no token of that kind; stale_token_frac the older share.
    mismatch: float = 0.0
    mismatch_engine: float | None = None
    staleness_shift: float | None = None
    stale_token_frac: float = 0.0
    # Mean over the batch's optimizer steps, before clipping.
    grad_norm: float = 0.0
    # Optimizer steps on this batch (GRPOConfig.mini_batches, fewer when it has fewer sequences).
    optimizer_steps: int = 0
    groups: int = 0
    groups_skipped_all_equal: int = 0
    frac_all_equal_groups: float = 0.0
    infra_error_samples: int = 0
    unscored_samples: int = 0
    # SCORED samples with a policy turn cut by its token limit (finish reason LENGTH), and those
    # of them trained on no token (GRPOConfig.mask_truncated, in groups with signal).
    length_cut_samples: int = 0
    truncated_masked_samples: int = 0
    sequences: int = 0
    # Forward/backward passes of the optimizer steps (the no-grad pi_old pass not counted).
    micro_batches: int = 0
    tokens: int = 0
    reward_mean: float = 0.0
    reward_std: float = 0.0
    reward_min: float = 0.0
    reward_max: float = 0.0
    # |A_i| over the batch's SCORED samples, and the share of them with A_i != 0 (a group whose
    # rewards are all equal gives 0): with rollout.grouping step, the step groups' advantages.
    advantage_abs_mean: float = 0.0
    advantage_nonzero_frac: float = 0.0
    # Context length of each policy turn of those samples (tokens before the turn's completion).
    prompt_tokens_per_turn_mean: float = 0.0
    prompt_tokens_per_turn_max: int = 0
    # The step's peak memory in GB (learner/memory.py): the process's resident set (Linux) and
    # torch's CUDA allocation; None where not measured.
    peak_rss_gb: float | None = None
    peak_gpu_gb: float | None = None


def _advantage_and_turn_stats(advantages: list[float], turn_prompts: list[int]) -> dict[str, float]:
    stats: dict[str, float] = {}
    if advantages:
        stats["advantage_abs_mean"] = sum(abs(a) for a in advantages) / len(advantages)
        stats["advantage_nonzero_frac"] = sum(a != 0.0 for a in advantages) / len(advantages)
    if turn_prompts:
        stats["prompt_tokens_per_turn_mean"] = sum(turn_prompts) / len(turn_prompts)
        stats["prompt_tokens_per_turn_max"] = max(turn_prompts)
    return stats


def _mismatch_split(totals: dict[str, float]) -> dict[str, float | None]:
    current, stale = totals["tokens_current"], totals["tokens"] - totals["tokens_current"]
    stale_sum = totals["mismatch"] - totals["mismatch_current"]
    return {
        "mismatch_engine": totals["mismatch_current"] / current if current else None,
        "staleness_shift": stale_sum / stale if stale else None,
        "stale_token_frac": stale / totals["tokens"],
    }


def _reward_stats(rewards: list[float]) -> dict[str, float]:
    if not rewards:
        return {}
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return {
        "reward_mean": mean,
        "reward_std": std,
        "reward_min": min(rewards),
        "reward_max": max(rewards),
    }


class StepInterrupted(Exception):
    """`interrupt` was set while a step ran: the step stopped between micro-batches and left the
    weights, the AdamW state, `step` and `policy_version` as they were before it."""


class GRPOTrainer:
    """Owns the model, the AdamW optimizer and the policy version.

    `model` is a causal LM called as model(input_ids=, attention_mask=) returning logits (or an
    object with .logits), already on its training device. Under torchrun (world size > 1, process
    group initialised) the model is sharded with FSDP2 here. Its weights and the optimizer state
    are fp32 in every precision (learner/precision.py); `push_dtype` is the dtype the policy
    servers hold, which `state_dict_for_push` converts to (default: fp32).

    With `lora`, the model is the frozen base of a LoRA adapter (learner/lora.py): only the
    adapter's parameters are in AdamW, `state_dict_for_push` gives only its tensors, and the KL
    reference is the base with the adapter switched off. `model_name` names the base in checkpoints.
    """

    def __init__(
        self,
        model: nn.Module,
        config: GRPOConfig,
        *,
        reference_model: nn.Module | None = None,
        pad_token_id: int = 0,
        push_dtype: torch.dtype | None = None,
        lora: LoraSpec | None = None,
        model_name: str = "",
    ) -> None:
        self.config = config
        self.push_dtype = push_dtype or torch.float32
        self.pad_token_id = pad_token_id
        self.context = current_context()
        torch.manual_seed(config.seed)
        self.device = next(model.parameters()).device

        refuse_unsupported(lora, precision=config.precision, world_size=self.context.world_size)

        self.reference_model: nn.Module | None = None
        if config.kl_coef > 0 and (reference_model is not None or lora is None):
            # The frozen reference defaults to the starting weights (with LoRA: the base itself,
            # the adapter switched off, see _reference_logprobs).
            reference = reference_model if reference_model is not None else copy.deepcopy(model)
            self.reference_model = self._prepare(reference).eval().requires_grad_(False)
        self.model = self._prepare(model)
        self.lora = None if lora is None else LoraWeights.wrap(self.model, lora, model_name)
        if self.lora is not None:
            self.model = self.lora.model
        self.model.train()
        # Every parameter, or with LoRA the adapter's alone (the base is frozen).
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]

        self.optimizer = torch.optim.AdamW(
            self.trainable,
            lr=config.lr,
            betas=config.adam_betas,
            weight_decay=config.weight_decay,
            fused=_fused_adamw(self.trainable),
        )
        self.step = 0
        self.policy_version = 0
        self._snapshot = _Snapshot(self.optimizer)
        # Set from another thread (a stopping learner) to end the step in flight at its next
        # micro-batch, all or nothing (StepInterrupted). One process only: ranks under torchrun
        # run collectives in lockstep, so there a step always runs to its end.
        self.interrupt = threading.Event()
        # A test hook (learner.faults.micro_batch_delay_s): each micro-batch waits this long
        # first, as a slow model would; an interrupt ends the wait.
        self.micro_batch_delay_s = 0.0

    def _prepare(self, model: nn.Module) -> nn.Module:
        model = prepare_model(model, self.config.precision)
        if self.context.is_distributed:
            model = shard_model(model, self.device.type, fsdp_policy(self.config.precision))
        return model

    def _next_micro_batch(self) -> None:
        """Between micro-batches: where a step in flight may be interrupted."""
        if self.micro_batch_delay_s:
            self.interrupt.wait(self.micro_batch_delay_s)
        if self.interrupt.is_set() and not self.context.is_distributed:
            raise StepInterrupted(f"step {self.step + 1} interrupted between micro-batches")

    def compute(self) -> contextlib.AbstractContextManager[None]:
        """The precision of a forward pass (bf16 autocast in one process; see learner/precision.py)."""
        return autocast(self.config.precision, self.device.type, sharded=self.context.is_distributed)

    def train_step(self, groups: list[RolloutGroup]) -> StepMetrics:
        """One batch of groups, GRPO (`grpo_step`) or SFT (`sft_step`), with the step's peak memory
        measured and what it freed given back to the OS (learner/memory.py)."""
        memory = StepMemory.start()
        try:
            if groups and all(g.objective is Objective.SFT for g in groups):
                metrics = self.sft_step(groups)
            else:
                metrics = self.grpo_step(groups)
        finally:
            peaks = memory.finish()
        return metrics.model_copy(update=peaks)

    def grpo_step(self, groups: list[RolloutGroup]) -> StepMetrics:
        """One batch of groups: pi_old once, then K = `mini_batches` optimizer steps, one new policy
        version. Every rank must pass the same groups.

            log pi_old(y_t)   every trained token, by the weights before the batch's first step
            for mini-batch k = 1..K  (the batch in order, ~N/K trained tokens each; N_k of them):
                L_k   = -(1/N_k) sum_{t in k} J_t  (+ kl_coef (1/N_k) sum_{t in k} KL_t)
                        J_t = w_t min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A)
                        rho_t = pi_theta(y_t) / pi_old(y_t)          (learner/grpo.py)
                theta <- AdamW(theta, clip_norm(grad L_k, max_grad_norm))
            policy_version += 1, step += 1          once per batch: one push carries all K steps

        rho = 1 in mini-batch 1 (pi_old is the policy being trained); from mini-batch 2 on, theta
        has moved and the clip bounds the step. Reported: loss = sum_k (N_k / N) L_k (each token's
        loss at its own step), token statistics as means over all N tokens, grad_norm the mean of
        the K norms before clipping, optimizer_steps = K.

        All or nothing: a batch that raises part-way leaves the weights, the AdamW state, `step`
        and `policy_version` as they were before it (`_Snapshot` says why).
        """
        if any(g.objective is Objective.SFT for g in groups):
            raise ValueError("a batch mixes sft and grpo groups; the buffer hands out one objective per batch")
        config = self.config
        plan = prepare_batch(groups, config)
        base = {
            "groups": plan.groups,
            "groups_skipped_all_equal": plan.groups_skipped_all_equal,
            "frac_all_equal_groups": plan.groups_skipped_all_equal / max(plan.groups, 1),
            "infra_error_samples": plan.infra_error_samples,
            "unscored_samples": plan.unscored_samples,
            "length_cut_samples": plan.length_cut_samples,
            "truncated_masked_samples": plan.truncated_masked_samples,
            "sequences": len(plan.sequences),
            "tokens": plan.num_tokens,
            **_reward_stats(plan.scored_rewards),
            **_advantage_and_turn_stats(plan.advantages, plan.turn_prompt_tokens),
        }
        if plan.num_tokens == 0:
            return StepMetrics(
                step=self.step, policy_version=self.policy_version, trained=False, **base
            )

        parts = split_mini_batches(plan.sequences, config.mini_batches)
        micro_batches = [self._micro_batches(part) for part in parts]
        # pi_old before any step. Mini-batch 1 trains on exactly these weights, so its own forward,
        # detached, is its pi_old; the later mini-batches need this no-grad pass.
        old_logprobs: list[list[torch.Tensor] | None] = [None]
        old_logprobs += [self._logprobs_no_grad(self.model, micro) for micro in micro_batches[1:]]

        sums = torch.zeros(len(STAT_NAMES), dtype=torch.float64)
        loss_sum = torch.zeros((), dtype=torch.float64)
        is_weight_max = torch.zeros((), dtype=torch.float64)
        grad_norms: list[float] = []
        # A batch is all or nothing: if it fails after an optimizer step (a later mini-batch runs
        # out of memory, a rank fails), the weights and AdamW state go back to the snapshot taken
        # before its first step, so its groups are retried on the policy they were sampled from.
        snapshot = self._snapshot if len(parts) > 1 else None
        if snapshot is not None:
            snapshot.take()
        try:
            self._optimizer_steps(parts, micro_batches, old_logprobs, plan.num_tokens,
                                  sums, loss_sum, is_weight_max, grad_norms)
        except BaseException:
            if snapshot is not None:
                snapshot.restore()
            self.optimizer.zero_grad(set_to_none=True)
            raise
        self.step += 1
        self.policy_version += 1

        totals = dict(zip(STAT_NAMES, sums.tolist()))
        tokens = totals["tokens"]
        return StepMetrics(
            step=self.step,
            policy_version=self.policy_version,
            trained=True,
            loss=float(loss_sum),
            kl=totals["kl"] / tokens,
            entropy=totals["entropy"] / tokens,
            clip_frac_low=totals["clip_low"] / tokens,
            clip_frac_high=totals["clip_high"] / tokens,
            is_weight_mean=totals["is_weight"] / tokens,
            is_weight_max=float(is_weight_max),
            is_frac_truncated=totals["is_truncated"] / tokens,
            mismatch=totals["mismatch"] / tokens,
            **_mismatch_split(totals),
            grad_norm=sum(grad_norms) / len(grad_norms),
            optimizer_steps=len(parts),
            micro_batches=sum(len(micro) for micro in micro_batches),
            **base,
        )

    def sft_step(self, groups: list[RolloutGroup]) -> StepMetrics:
        """One optimizer step of token-mean cross-entropy on the SFT groups' trained tokens
        (learner/sft.py), at `sft_lr` (default `lr`); one new policy version.

            L = -(1/N) sum_i sum_t m_t log p_theta(y_t | y_<t)
            theta <- AdamW(theta, clip_norm(grad L, max_grad_norm))

        All or nothing as `train_step`: with one step, a failure before `optimizer.step()` leaves
        the weights and the AdamW state untouched."""
        config = self.config
        sequences = sft_sequences(groups)
        tokens = int(sum(int(s.loss_mask.sum()) for s in sequences))
        base = {"objective": Objective.SFT.value, "groups": len(groups), "sequences": len(sequences),
                "tokens": tokens}
        if tokens == 0:
            return StepMetrics(step=self.step, policy_version=self.policy_version, trained=False, **base)
        local = sequences[self.context.rank :: self.context.world_size]
        packed = split_micro_batches(local, config.micro_batch_tokens) if local else []
        count = int(all_reduce(torch.tensor(len(packed)), dist.ReduceOp.MAX))
        packed += [[self._empty_sequence()]] * (count - len(packed))
        sums = torch.zeros(len(SFT_STAT_NAMES), dtype=torch.float64)
        self.optimizer.zero_grad(set_to_none=True)
        try:
            for sequences_of_micro in packed:
                self._next_micro_batch()
                batch = pad_right(sequences_of_micro, self.pad_token_id).to(self.device)
                with self.compute():
                    logits = _logits_of(self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask))
                loss, stats = sft_loss(logits, batch.input_ids, batch.loss_mask, tokens)
                (loss * self.context.world_size).backward()  # FSDP2 averages over ranks: make it the sum
                sums += torch.stack([stats[name].double().cpu() for name in SFT_STAT_NAMES])
            grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, config.max_grad_norm)
            if hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()
            all_reduce(sums, dist.ReduceOp.SUM)
            lr = config.sft_lr or config.lr
            saved = [group["lr"] for group in self.optimizer.param_groups]
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            try:
                self.optimizer.step()
            finally:
                for group, value in zip(self.optimizer.param_groups, saved):
                    group["lr"] = value
        except BaseException:
            self.optimizer.zero_grad(set_to_none=True)
            raise
        self.step += 1
        self.policy_version += 1
        totals = dict(zip(SFT_STAT_NAMES, sums.tolist()))
        mean_nll = totals["nll"] / totals["tokens"]
        return StepMetrics(
            step=self.step, policy_version=self.policy_version, trained=True, loss=mean_nll,
            sft_loss=mean_nll, sft_token_accuracy=totals["correct"] / totals["tokens"],
            grad_norm=float(grad_norm), optimizer_steps=1, micro_batches=len(packed), **base)

    def _optimizer_steps(
        self,
        parts: list[list[TrainSequence]],
        micro_batches: list[list[tuple[MicroBatch, int]]],
        old_logprobs: list[list[torch.Tensor] | None],
        num_tokens: int,
        sums: torch.Tensor,
        loss_sum: torch.Tensor,
        is_weight_max: torch.Tensor,
        grad_norms: list[float],
    ) -> None:
        """The K optimizer steps of a batch, accumulating its statistics in place (all-reduced over
        the ranks before the last step, so that the last optimizer step is the last thing that can
        fail: with K = 1 a failure leaves the weights untouched without a snapshot)."""
        config = self.config
        last = len(parts) - 1
        version = self.policy_version  # pi_old's: the tokens it sampled show the engine mismatch
        for k, (part, micro, part_old) in enumerate(zip(parts, micro_batches, old_logprobs, strict=True)):
            part_tokens = sum(int(seq.loss_mask.sum()) for seq in part)  # N_k, all ranks together
            self.optimizer.zero_grad(set_to_none=True)
            for index, (batch, shared) in enumerate(micro):
                self._next_micro_batch()
                with self.compute():
                    logprobs, entropy = sequence_logprobs_and_entropy(self.model, batch, shared,
                                                                      packed=config.skip_padding)
                old = logprobs.detach() if part_old is None else part_old[index]
                ref_logprobs = self._reference_logprobs(batch, shared)
                # This micro-batch's share of L_k: -(1/N_k) sum_t J_t over its tokens.
                loss, stats = grpo_loss(
                    logprobs,
                    old,
                    batch.rollout_logprobs,
                    batch.advantages,
                    batch.loss_mask,
                    part_tokens,
                    config,
                    ref_logprobs,
                    current=(batch.policy_versions == version).float(),
                )
                # FSDP2 averages gradients over ranks; the loss is already a share of the global
                # sum, so scale by world size to make that average the sum.
                (loss * self.context.world_size).backward()
                stats["entropy"] = (entropy * batch.loss_mask).sum()
                sums += torch.stack([stats[name].double().cpu() for name in STAT_NAMES])
                loss_sum += loss.detach().double().cpu() * part_tokens / num_tokens
                is_weight_max.copy_(torch.maximum(is_weight_max, stats["is_weight_max"].double().cpu()))
            grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, config.max_grad_norm)
            if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2
                grad_norm = grad_norm.full_tensor()
            grad_norms.append(float(grad_norm))
            if k == last:
                all_reduce(sums, dist.ReduceOp.SUM)
                all_reduce(loss_sum, dist.ReduceOp.SUM)
                all_reduce(is_weight_max, dist.ReduceOp.MAX)
            self.optimizer.step()

    def _micro_batches(self, part: list[TrainSequence]) -> list[tuple[MicroBatch, int]]:
        """This rank's micro-batches of a mini-batch, on the device, each with its shared prefix.

        Data parallel: each rank takes every world_size-th sequence. All ranks must run the same
        number of forward/backward passes (FSDP2 collectives), so short ranks pad with empty ones.
        """
        config = self.config
        local = part[self.context.rank :: self.context.world_size]
        packed = split_micro_batches(local, config.micro_batch_tokens, config.shared_prefix_min_tokens)
        count = int(all_reduce(torch.tensor(len(packed)), dist.ReduceOp.MAX))
        packed += [[self._empty_sequence()]] * (count - len(packed))
        batches = [pad_right(sequences, self.pad_token_id, self.config.temperature).to(self.device)
                   for sequences in packed]
        return [(batch, self._shared_prefix(batch)) for batch in batches]

    def _logprobs_no_grad(self, model: nn.Module, micro: list[tuple[MicroBatch, int]]) -> list[torch.Tensor]:
        with torch.no_grad(), self.compute():
            return [sequence_logprobs_and_entropy(model, batch, shared, packed=self.config.skip_padding)[0]
                    for batch, shared in micro]

    def _empty_sequence(self) -> TrainSequence:
        """Two pad tokens with nothing trained: a forward/backward that adds zero gradient."""
        return TrainSequence(
            token_ids=torch.full((2,), self.pad_token_id, dtype=torch.long),
            loss_mask=torch.zeros(2),
            rollout_logprobs=torch.zeros(2),
            advantage=0.0,
        )

    def _shared_prefix(self, batch: MicroBatch) -> int:
        """The prefix of this micro-batch to run once (0: none). Under FSDP2 every rank must make
        the same number of forward calls, each gathering the weights, so a shared prefix is used
        only when every rank's micro-batch at this index has one."""
        shared = usable_shared_prefix(self.model, batch, self.config.shared_prefix_min_tokens)
        everywhere = all_reduce(torch.tensor(int(shared > 0)), dist.ReduceOp.MIN)
        return shared if int(everywhere) else 0

    def _reference_logprobs(self, batch: MicroBatch, shared: int) -> torch.Tensor | None:
        if self.reference_model is not None:
            return self._logprobs_no_grad(self.reference_model, [(batch, shared)])[0]
        if self.lora is not None and self.config.kl_coef > 0:
            with self.lora.base_only():
                return self._logprobs_no_grad(self.model, [(batch, shared)])[0]
        return None

    def state_dict_for_push(self) -> dict[str, torch.Tensor]:
        """Full weights on CPU in `push_dtype`, named as in the model's state dict (empty on ranks
        other than 0). Floating tensors are converted from the fp32 masters (a copy; the masters
        are untouched); entries that share memory (tied embeddings) still share it afterwards.

        With LoRA: the adapter's tensors only, named as PEFT saves them (sciproto/lora.py).

        Collective under FSDP2: every rank must call it.
        """
        if self.lora is not None:
            return self.lora.state_dict(self.push_dtype)
        weights = full_state_dict(self.model)
        converted: dict[tuple[int, int, tuple[int, ...]], torch.Tensor] = {}
        result = {}
        for name, tensor in weights.items():
            if not tensor.is_floating_point() or tensor.dtype == self.push_dtype:
                result[name] = tensor
                continue
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
            if key not in converted:
                converted[key] = tensor.to(self.push_dtype)
            result[name] = converted[key]
        return result


def _fused_adamw(parameters: list[nn.Parameter]) -> bool | None:
    """AdamW's fused kernel, one pass over each tensor (about 6x the default per-tensor loop for
    SmolLM2 on one CPU thread: 0.10 against 0.65 s a step), where it runs: plain fp32 tensors on
    the CPU or a CUDA GPU (not FSDP2's sharded DTensors). None: torch's default."""
    plain = all(type(p) is nn.Parameter and p.dtype == torch.float32 and p.device.type in ("cpu", "cuda")
                for p in parameters)
    return True if parameters and plain else None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2), or the tensor itself; shares its memory."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class _Snapshot:
    """A copy, in host memory, of the weights and AdamW state before a batch's first optimizer step,
    to put back if the batch fails part-way.

    Why restore rather than count the partial update as a version: the failed batch's groups go
    back to the buffer and are trained again; on weights that already took some of its mini-batch
    steps they would be trained twice, under a pi_old that is no longer the policy that sampled
    them, and the learner would hold weights no policy server serves and no checkpoint names.
    Restoring makes a failed step leave no trace: the retry is the step that never failed.

    Cost: one host copy of the fp32 weights and of AdamW's two moments (this rank's shards under
    FSDP2) per batch, taken only when the batch makes more than one optimizer step; with one, that
    step is the batch's last fallible operation and nothing needs undoing. The host buffers are
    kept and refilled batch after batch (pinned when training on a GPU), so a snapshot costs a
    copy, not an allocation.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        # The optimizer's parameters: under FSDP2 these are the sharded DTensors the optimizer
        # updates, whereas model.parameters() can yield a module's unsharded parameters, whose
        # memory FSDP2 frees when it reshards (copying into one crashed the process).
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self._buffers: dict[tuple[int, str], torch.Tensor] = {}
        self.state: dict[nn.Parameter, dict[str, object]] = {}

    def _copy(self, key: tuple[int, str], tensor: torch.Tensor) -> torch.Tensor:
        source = _local(tensor).detach()
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            buffer = torch.empty(source.shape, dtype=source.dtype, device="cpu",
                                 pin_memory=source.device.type == "cuda")
            self._buffers[key] = buffer
        buffer.copy_(source, non_blocking=True)
        return buffer

    def take(self) -> None:
        """Copy the weights and optimizer state as they are now."""
        with torch.no_grad():
            for number, param in enumerate(self.params):
                self._copy((number, ""), param)
            self.state = {
                param: {k: self._copy((number, k), v) if torch.is_tensor(v) else v
                        for k, v in self.optimizer.state[param].items()}
                for number, param in enumerate(self.params)
                if param in self.optimizer.state
            }
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the non-blocking copies have landed

    def restore(self) -> None:
        with torch.no_grad():
            for number, param in enumerate(self.params):
                _local(param).copy_(self._buffers[(number, "")])
                if param not in self.state:  # the batch made its first step: no state before it
                    self.optimizer.state.pop(param, None)
                    continue
                current = self.optimizer.state[param]
                for key in set(current) - set(self.state[param]):
                    del current[key]
                for key, value in self.state[param].items():
                    if torch.is_tensor(value) and torch.is_tensor(current.get(key)):
                        _local(current[key]).copy_(value)
                    else:  # a state entry the failed step replaced: the saved copy, on its device
                        current[key] = value.to(_local(param).device, copy=True) if torch.is_tensor(value) else value
