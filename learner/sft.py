"""Supervised fine-tuning on demonstrations: token-mean cross-entropy on the loss-masked tokens.

Notation (per token t of demonstration i; m_t = loss_mask, 1 on the assistant's tokens):
    z_t          the logits at position t - 1 (they predict y_t), temperature 1
    p_theta(y_t) = softmax(z_t)[y_t]
    N            = sum_i sum_t m_t                           trained tokens of the batch (all ranks)
    L            = -(1/N) sum_i sum_t m_t log p_theta(y_t)    token-mean cross-entropy ("sft_loss")
    dL/dz_t      = (1/N) m_t (softmax(z_t) - onehot(y_t))    its gradient on the logits
    acc          = (1/N) sum_i sum_t m_t [argmax_v z_t,v = y_t]   "sft_token_accuracy" (metric only)

Every sample of an SFT group trains except INFRA_ERROR ones, whatever its reward: the group is a
set of demonstrations, not a comparison, so it has no advantage and no staleness. One optimizer
step per batch (AdamW at `sft_lr`, gradients clipped to max_grad_norm), one new policy version. A
micro-batch's loss is its share of L (its tokens' sum over N): the micro-batches sum to L exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from learner.grpo import TrainSequence
from learner.logprobs import token_logprobs
from learner.types import RewardStatus, RolloutGroup

__all__ = ["SFT_STAT_NAMES", "sft_loss", "sft_sequences"]

# Order of the summed statistics, so that ranks can all-reduce them as one tensor.
SFT_STAT_NAMES = ("nll", "correct", "tokens")


def sft_sequences(groups: Sequence[RolloutGroup]) -> list[TrainSequence]:
    """The trained samples of SFT groups as sequences (advantage unused, 0)."""
    return [
        TrainSequence(
            token_ids=torch.tensor(sample.token_ids, dtype=torch.long),
            loss_mask=torch.tensor(sample.loss_mask, dtype=torch.float32),
            rollout_logprobs=torch.zeros(len(sample.token_ids)),
            advantage=0.0,
        )
        for group in groups
        for sample in group.samples
        if sample.reward_status is not RewardStatus.INFRA_ERROR and sample.num_trained_tokens
    ]


def sft_loss(
    logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro-batch's share of L, and its summed statistics (SFT_STAT_NAMES).

    logits [B, T, V] of input_ids [B, T]; loss_mask [B, T-1] aligned with the predicted ids[:, 1:];
    num_tokens is N of the whole batch. Computed in float32 whatever the model's dtype.
    """
    if num_tokens <= 0:
        raise ValueError("sft_loss needs num_tokens > 0: the batch has no trained tokens")
    targets = input_ids[:, 1:]
    chosen, _ = token_logprobs(logits, targets)  # log p_theta(y_t), chunked (learner/logprobs.py)
    nll = -(chosen * loss_mask).sum()  # sum_t m_t (-log p_theta(y_t))
    loss = nll / num_tokens
    with torch.no_grad():
        correct = ((logits[:, :-1].argmax(-1) == targets).float() * loss_mask).sum()
        sums = {"nll": nll.detach(), "correct": correct, "tokens": loss_mask.sum()}
    return loss, sums
