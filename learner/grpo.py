"""Asynchronous GRPO: group-normalised advantages and the clipped, importance-corrected token loss.

Notation (per trained token t of sample i in group g):
    r_i          reward of sample i (SCORED samples only)
    A_i          = (r_i - mean_g r) / (std_g r + adv_eps)               group-normalised advantage
    pi_theta     the policy being trained, under the distribution that sampled y_t: its
                 temperature T_t, top-k and top-p (sciproto/sampling.py; learner/logprobs.py),
                 pi_theta(y_t) = softmax(logits_t / T_t over the kept tokens)[y_t]; mu the rollout
                 policy (the policy servers' logprobs, of the same processed distribution)
    pi_old       the policy before the batch's first optimizer step (fixed for the whole batch)
    rho_t        = pi_theta(y_t) / pi_old(y_t)                           PPO ratio
    w_t          = min(pi_old(y_t) / mu(y_t), is_cap)  (detached)        truncated importance weight
    J_t          = w_t * min(rho_t A_i, clip(rho_t, 1 - eps_low, 1 + eps_high) A_i)
    L_k          = -(1/N_k) sum_{t in k} J_t  (+ kl_coef (1/N_k) sum_{t in k} KL_t)

A batch takes K = `mini_batches` optimizer steps, step k on mini-batch k of the batch (its parts in
order, about N/K trained tokens each; learner/trainer.py). N_k counts every trained completion
token of mini-batch k across all ranks: each step takes the token mean of its own part, so its size
does not depend on K, and with K = 1, N_1 = N, the whole batch. A micro-batch's loss is its share of
L_k: the micro-batches of a mini-batch sum to exactly its loss and gradient.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from learner.config import GRPOConfig
from learner.logprobs import token_logprobs
from learner.types import RewardStatus, RolloutGroup, TrainSample


@dataclass(frozen=True)
class TrainSequence:
    """One sequence ready for the loss: the tensors of a sample and its advantage."""

    token_ids: torch.Tensor  # [T] long
    loss_mask: torch.Tensor  # [T] float, 1 where trained
    rollout_logprobs: torch.Tensor  # [T] float, mu
    advantage: float
    # [T] long: the policy version that sampled each trained token whole (`whole_versions`; -1
    # elsewhere); None: unknown.
    policy_versions: torch.Tensor | None = None
    # Its group's place in the batch (-1: none): the packing keeps a group's sequences together.
    group: int = -1
    # [T, 3] float: (temperature, top_p, top_k) each token was sampled under; None: the
    # learner's temperature, untruncated, everywhere.
    sampling: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return int(self.token_ids.numel())


@dataclass
class BatchPlan:
    """What one training step trains on, and what it left out and why."""

    sequences: list[TrainSequence]
    num_tokens: int  # N: trained completion tokens of the whole batch
    groups: int
    groups_skipped_all_equal: int
    infra_error_samples: int
    unscored_samples: int
    # SCORED samples with a policy turn cut by its token limit, and those of them left untrained
    # (GRPOConfig.mask_truncated; only groups with signal train anything).
    length_cut_samples: int = 0
    truncated_masked_samples: int = 0
    scored_rewards: list[float] = field(default_factory=list)
    # A_i of every SCORED sample (0 in a group without signal), and the prompt length of every
    # policy turn of those samples: the tokens before the turn's first trained token.
    advantages: list[float] = field(default_factory=list)
    turn_prompt_tokens: list[int] = field(default_factory=list)


def group_advantages(rewards: Sequence[float], adv_eps: float) -> list[float] | None:
    """A_i = (r_i - mean r) / (std r + adv_eps), or None when the group carries no signal.

    A group needs at least two rewards that differ: with all rewards equal every advantage is 0
    and the group would only dilute the token normaliser.
    """
    if len(rewards) < 2 or max(rewards) == min(rewards):
        return None
    mean = sum(rewards) / len(rewards)
    # Population std (divide by n), as in the GRPO paper's group statistics.
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return [(r - mean) / (std + adv_eps) for r in rewards]


def scored_samples(group: RolloutGroup) -> list[TrainSample]:
    """The samples that may train: INFRA_ERROR and UNSCORED samples are masked out entirely."""
    return [s for s in group.samples if s.reward_status is RewardStatus.SCORED]


def episodes(samples: Sequence[TrainSample]) -> tuple[list[int], list[float]]:
    """Each sample's episode (numbered in order of first appearance) and each episode's reward.
    Samples with the same non-empty `episode` are the segments of one episode (an agent that
    rewrote its history): one sample of the group's statistics, its reward counted once."""
    numbers: dict[str, int] = {}
    of: list[int] = []
    rewards: list[float] = []
    for i, sample in enumerate(samples):
        number = numbers.setdefault(sample.episode or f"\0{i}", len(numbers))
        if number == len(rewards):
            rewards.append(sample.reward)
        of.append(number)
    return of, rewards


def group_has_signal(group: RolloutGroup) -> bool:
    _, rewards = episodes(scored_samples(group))
    return group_advantages(rewards, adv_eps=1.0) is not None


def split_into_transitions(sample: TrainSample) -> list[TrainSample]:
    """Per-transition mode: one sample per assistant turn, each sharing the trajectory's reward.

    A turn is a maximal run of trained tokens; its sample holds the context before it and the turn,
    and trains only that turn. Every trained token lands in exactly one transition, so with the
    trajectory's advantage the loss is unchanged while no sequence is longer than needed.
    """
    transitions: list[TrainSample] = []
    mask = sample.loss_mask
    t = 0
    while t < len(mask):
        if mask[t] == 0:
            t += 1
            continue
        start = t
        while t < len(mask) and mask[t] == 1:
            t += 1
        transitions.append(
            sample.model_copy(
                update={
                    "token_ids": sample.token_ids[:t],
                    "loss_mask": [0] * start + [1] * (t - start),
                    "rollout_logprobs": sample.rollout_logprobs[:t],
                    "policy_versions": sample.policy_versions[:t],
                    "sampling_spans": [span for span in sample.sampling_spans if span[0] < t],
                }
            )
        )
    return transitions


def turn_prompt_lengths(sample: TrainSample) -> list[int]:
    """The context length each policy turn was sampled from: the index of the first token of every
    maximal run of trained tokens (a step group's sample has one turn: its shared prompt)."""
    mask = sample.loss_mask
    return [t for t in range(1, len(mask)) if mask[t] == 1 and mask[t - 1] == 0]


def untruncated(length: int, temperature: float) -> torch.Tensor:
    """[length, 3] rows of (temperature, 1, 0): tokens sampled at `temperature`, untruncated."""
    return torch.tensor([[temperature, 1.0, 0.0]]).repeat(length, 1)


def sampling_tensor(sample: TrainSample, temperature: float) -> torch.Tensor:
    """[T, 3] (temperature, top_p, top_k) of each token: its sampling span's, else (temperature,
    1, 0)."""
    n = len(sample.token_ids)
    table = untruncated(n, temperature)
    for start, end, t, top_p, top_k in sample.sampling_spans:
        table[start:min(end, n)] = torch.tensor([t, top_p, float(top_k)])
    return table


def whole_versions(versions: torch.Tensor, trained: torch.Tensor) -> torch.Tensor:
    """[T] long: the version that computed everything each token's distribution depended on, -1
    where no single one did (and where nothing is trained). A policy turn (a maximal run of trained
    tokens) runs on one KV cache: an update that lands mid-turn leaves the turn's prompt and earlier
    tokens computed by the old weights, and the tokens after it are drawn by the new weights over
    that cache. So a token keeps its version only when its turn started at that version."""
    trained = trained.bool()
    starts = trained & ~F.pad(trained[:-1], (1, 0))  # each turn's first token: prefilled and sampled by its version
    turn = torch.cumsum(starts, 0) - 1  # the turn of each token (-1 before the first)
    started_at = versions[starts][turn.clamp(min=0)] if bool(starts.any()) else versions
    return torch.where(trained & (versions == started_at), versions, torch.full_like(versions, -1))


def _to_sequence(sample: TrainSample, advantage: float, group: int, temperature: float) -> TrainSequence:
    loss_mask = torch.tensor(sample.loss_mask, dtype=torch.float32)
    return TrainSequence(
        token_ids=torch.tensor(sample.token_ids, dtype=torch.long),
        loss_mask=loss_mask,
        rollout_logprobs=torch.tensor(sample.rollout_logprobs, dtype=torch.float32),
        advantage=advantage,
        policy_versions=whole_versions(torch.tensor(sample.policy_versions, dtype=torch.long), loss_mask),
        group=group,
        sampling=sampling_tensor(sample, temperature),
    )


def prepare_batch(groups: Sequence[RolloutGroup], config: GRPOConfig) -> BatchPlan:
    """Advantages per group over its SCORED samples (an episode's segments are one sample, see
    `episodes`); groups without signal are counted and skipped.

    With `mask_truncated`, a sample cut by its token limit keeps its place in the group's
    statistics (A_i of the others is unchanged) but contributes no token to the loss or to N.
    """
    sequences: list[TrainSequence] = []
    skipped = infra = unscored = length_cut = masked = 0
    rewards: list[float] = []
    all_advantages: list[float] = []
    turn_prompts: list[int] = []
    for index, group in enumerate(groups):
        infra += sum(s.reward_status is RewardStatus.INFRA_ERROR for s in group.samples)
        unscored += sum(s.reward_status is RewardStatus.UNSCORED for s in group.samples)
        samples = scored_samples(group)
        episode_of, episode_rewards = episodes(samples)
        rewards.extend(episode_rewards)
        length_cut += sum(s.cut_by_length for s in samples)
        turn_prompts.extend(length for s in samples for length in turn_prompt_lengths(s))
        advantages = group_advantages(episode_rewards, config.adv_eps)
        all_advantages.extend(advantages or [0.0] * len(episode_rewards))
        if advantages is None:
            skipped += 1
            continue
        for sample, episode in zip(samples, episode_of):
            advantage = advantages[episode]  # every segment of an episode trains with its advantage
            if config.mask_truncated and sample.cut_by_length:
                masked += 1
                continue
            if sample.num_trained_tokens == 0:
                continue  # nothing to train: it would only cost a forward pass
            parts = split_into_transitions(sample) if config.per_transition else [sample]
            sequences.extend(_to_sequence(part, advantage, index, config.temperature) for part in parts)
    num_tokens = int(sum(seq.loss_mask.sum().item() for seq in sequences))
    return BatchPlan(
        sequences=sequences,
        num_tokens=num_tokens,
        groups=len(groups),
        groups_skipped_all_equal=skipped,
        infra_error_samples=infra,
        unscored_samples=unscored,
        length_cut_samples=length_cut,
        truncated_masked_samples=masked,
        scored_rewards=rewards,
        advantages=all_advantages,
        turn_prompt_tokens=turn_prompts,
    )


def split_mini_batches(sequences: Sequence[TrainSequence], count: int) -> list[list[TrainSequence]]:
    """The batch in order as `count` parts of about N / count trained tokens each (at most one part
    per sequence, none empty): part k ends after the sequence where the running token count
    reaches k N / count. In order, a group's samples stay together wherever a cut allows."""
    count = min(count, len(sequences))
    cumulative = list(itertools.accumulate(int(s.loss_mask.sum()) for s in sequences))
    total = cumulative[-1] if cumulative else 0
    bounds = [0]
    for k in range(1, count):
        end = 1 + next(i for i, c in enumerate(cumulative) if c >= k * total / count)
        bounds.append(min(max(end, bounds[-1] + 1), len(sequences) - (count - k)))
    bounds.append(len(sequences))
    return [list(sequences[a:b]) for a, b in itertools.pairwise(bounds)]


def common_prefix_length(a: torch.Tensor, b: torch.Tensor) -> int:
    """Number of leading tokens two sequences share."""
    n = min(a.numel(), b.numel())
    differs = (a[:n] != b[:n]).nonzero()
    return int(differs[0]) if differs.numel() else n


def micro_batch_positions(sequences: Sequence[TrainSequence], min_shared_prefix: int = 0) -> int:
    """Token positions one micro-batch of `sequences` runs (see split_micro_batches)."""
    longest = max(seq.length for seq in sequences)
    shared = sequences[0].length
    for seq in sequences[1:]:
        shared = common_prefix_length(sequences[0].token_ids[:shared], seq.token_ids)
    counted = shared if len(sequences) > 1 and 0 < min_shared_prefix <= shared else 0
    return counted + len(sequences) * (longest - counted)


def split_micro_batches(
    sequences: Sequence[TrainSequence], micro_batch_tokens: int, min_shared_prefix: int = 0
) -> list[list[TrainSequence]]:
    """Packing in order: each micro-batch keeps its token positions within the budget.

    Positions of B sequences padded to length T that share a prefix of P tokens, counted when
    P >= min_shared_prefix > 0 (learner/prefix.py runs it once):  P + B (T - P);  otherwise B T.
    With the prefix counted, a group's sequences (one prompt) go as a run, and a run joins the
    micro-batch before it only when that costs no more positions than a micro-batch of its own:
    two groups on different prompts share only what their prompts have in common, and every row
    would run the rest of its prompt again. A sequence longer than the budget gets a micro-batch
    of its own.
    """
    runs: list[list[TrainSequence]] = []
    for seq in sequences:
        if runs and min_shared_prefix > 0 and seq.group >= 0 and runs[-1][-1].group == seq.group:
            runs[-1].append(seq)
        else:
            runs.append([seq])
    return _pack(runs, micro_batch_tokens, min_shared_prefix)


def _pack(runs: list[list[TrainSequence]], budget: int, min_shared_prefix: int) -> list[list[TrainSequence]]:
    """Greedy over runs (see split_micro_batches). Runs of one sequence have no prefix of their
    own to lose and pack up to the budget, as do all runs when no prefix is counted. A run that
    does not fit is packed on its own, sequence by sequence."""
    batches: list[list[TrainSequence]] = []
    current: list[TrainSequence] = []
    grouped = False  # current holds a run of more than one sequence
    for run in runs:
        if current:
            merged = micro_batch_positions([*current, *run], min_shared_prefix)
            apart = micro_batch_positions(current, min_shared_prefix) + micro_batch_positions(run, min_shared_prefix)
            if merged <= budget and (merged <= apart or min_shared_prefix <= 0 or not grouped and len(run) == 1):
                current += run
                grouped = grouped or len(run) > 1
                continue
            batches.append(current)
            current, grouped = [], False
        for seq in run:
            if current and micro_batch_positions([*current, seq], min_shared_prefix) > budget:
                batches.append(current)
                current = []
            current.append(seq)
        grouped = len(current) > 1
    if current:
        batches.append(current)
    return batches


@dataclass(frozen=True)
class MicroBatch:
    """Right-padded tensors; per-token tensors are aligned with the predicted tokens ids[:, 1:]."""

    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    loss_mask: torch.Tensor  # [B, T-1]
    rollout_logprobs: torch.Tensor  # [B, T-1]
    advantages: torch.Tensor  # [B]
    # [B, T-1] long: the version that sampled each token whole (`whole_versions`), -1 where
    # unknown, not trained, or drawn over the KV cache of an older version
    policy_versions: torch.Tensor
    # [B, T-1, 3] float: (temperature, top_p, top_k) each predicted token was sampled under
    sampling: torch.Tensor

    def to(self, device: torch.device | str) -> MicroBatch:
        return MicroBatch(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))


def pad_right(sequences: Sequence[TrainSequence], pad_token_id: int = 0, temperature: float = 1.0) -> MicroBatch:
    """`temperature`: of the sequences that do not say what sampled them (TrainSequence.sampling)."""
    if not sequences:
        raise ValueError("pad_right needs at least one sequence")
    length = max(seq.length for seq in sequences)

    def stack(values: list[torch.Tensor], fill: float) -> torch.Tensor:
        return torch.stack([F.pad(v, (0, length - v.numel()), value=fill) for v in values])

    ids = stack([s.token_ids for s in sequences], pad_token_id)
    attention = stack([torch.ones(s.length, dtype=torch.long) for s in sequences], 0)
    return MicroBatch(
        input_ids=ids,
        attention_mask=attention,
        loss_mask=stack([s.loss_mask for s in sequences], 0.0)[:, 1:],
        rollout_logprobs=stack([s.rollout_logprobs for s in sequences], 0.0)[:, 1:],
        advantages=torch.tensor([s.advantage for s in sequences], dtype=torch.float32),
        policy_versions=stack([_versions(s) for s in sequences], -1)[:, 1:],
        # padding reads as T = 1, untruncated: it trains nothing and must not make the batch
        # take the truncation rule's path (learner/logprobs.py)
        sampling=torch.stack([torch.cat([_sampling(s, temperature), untruncated(length - s.length, 1.0)])
                              for s in sequences])[:, 1:],
    )


def _sampling(sequence: TrainSequence, temperature: float) -> torch.Tensor:
    if sequence.sampling is not None:
        return sequence.sampling
    return untruncated(sequence.length, temperature)


def _versions(sequence: TrainSequence) -> torch.Tensor:
    if sequence.policy_versions is not None:
        return sequence.policy_versions
    return torch.full((sequence.length,), -1, dtype=torch.long)


def token_logprobs_and_entropy(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0, sampling: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(y_t | y_<t) for t >= 1 and the policy entropy at each position (detached), of the
    policy sampled at `temperature`: pi = softmax(logits / T); or, with `sampling` [B, T-1, 3]
    (MicroBatch.sampling), each token under its own temperature, top-p and top-k.

    logits[:, t] predicts input_ids[:, t + 1]; computed in float32 whatever the model dtype, a
    chunk of positions at a time (learner/logprobs.py: no full-size float32 copies are kept).
    """
    if sampling is None:
        return token_logprobs(logits, input_ids[:, 1:], temperature)
    return sampled_logprobs(logits, input_ids[:, 1:], sampling)


def sampled_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, sampling: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(targets) and the entropy, [B, T] each, where logits[:, t] scores targets[:, t] and
    sampling[:, t] = (temperature, top_p, top_k) is what sampled that token. The truncated
    distribution (learner/logprobs.py) is computed only when some token had top_p < 1 or
    top_k > 0; otherwise every token takes the cheaper untruncated path, with the same values."""
    top_p, top_k = sampling[..., 1], sampling[..., 2].long()
    truncated = bool(((top_p < 1) | (top_k > 0)).any())
    return token_logprobs(logits, targets, sampling[..., 0].contiguous(),
                          top_p=top_p if truncated else None, top_k=top_k if truncated else None)


# Order of the summed statistics, so that ranks can all-reduce them as one tensor.
STAT_NAMES = (
    "objective",
    "kl",
    "entropy",
    "clip_low",
    "clip_high",
    "is_weight",
    "is_truncated",
    "mismatch",
    "mismatch_current",
    "tokens_current",
    "tokens",
)


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    num_tokens: int,
    config: GRPOConfig,
    ref_logprobs: torch.Tensor | None = None,
    current: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro-batch's share of the mini-batch loss L_k, and summed token statistics for the
    metrics.

    All per-token tensors are [B, T-1]; advantages is [B]; num_tokens is N_k of the mini-batch.
    `current` marks the tokens sampled by the learner's current version, pi_old (1.0) apart from
    those sampled by older versions (0.0); None counts every token as current.
    Returns (loss, sums) where sums has STAT_NAMES plus "is_weight_max" (a max, not a sum).
    """
    if num_tokens <= 0:
        raise ValueError("grpo_loss needs num_tokens > 0: the batch has no trained tokens")
    mask = loss_mask
    adv = advantages.unsqueeze(-1)  # A_i broadcast over the tokens of sample i

    # rho = pi_theta / pi_old; in the batch's first step pi_old = pi_theta.detach(): rho is 1 but
    # carries the gradient.
    rho = torch.exp(logprobs - old_logprobs)
    rho_clipped = torch.clamp(rho, 1.0 - config.eps_low, 1.0 + config.eps_high)
    surrogate = torch.minimum(rho * adv, rho_clipped * adv)

    # Importance weight of the trainer's pi_old against the rollout policy mu (detached).
    with torch.no_grad():
        is_ratio = torch.exp(old_logprobs - rollout_logprobs) * mask
        over_cap = (is_ratio > config.is_cap).float() * mask
        if config.is_correction == "truncate":
            weight = torch.clamp(is_ratio, max=config.is_cap)  # w = min(pi_old/mu, cap)
        elif config.is_correction == "mask":
            weight = is_ratio  # w = pi_old/mu, and tokens over the cap are dropped below
            mask = mask * (1.0 - over_cap)
        else:
            weight = torch.ones_like(is_ratio)

    objective = (weight * surrogate * mask).sum()
    loss = -objective / num_tokens

    kl_sum = torch.zeros((), device=logprobs.device)
    if ref_logprobs is not None and config.kl_coef > 0:
        # k3 estimator of KL(pi_theta || pi_ref): exp(d) - d - 1 with d = log pi_ref - log pi_theta
        d = ref_logprobs - logprobs
        kl = torch.exp(d) - d - 1.0
        kl_sum = (kl * mask).sum()
        loss = loss + config.kl_coef * kl_sum / num_tokens

    with torch.no_grad():
        trained = loss_mask
        # exp|log pi_old - log mu| (1 means identical), on the weights before this batch's steps:
        # on tokens sampled at pi_old's own version it is the inference/training (engine)
        # mismatch; on older tokens it adds the staleness shift of the updates since.
        gap = torch.exp((old_logprobs - rollout_logprobs).abs()) * trained
        current_mask = trained if current is None else trained * current
        sums = {
            "objective": objective.detach(),
            "kl": kl_sum.detach(),
            "clip_low": ((adv < 0) & (rho < 1.0 - config.eps_low)).float().mul(trained).sum(),
            "clip_high": ((adv > 0) & (rho > 1.0 + config.eps_high)).float().mul(trained).sum(),
            "is_weight": is_ratio.sum(),
            "is_truncated": over_cap.sum(),
            "mismatch": gap.sum(),
            "mismatch_current": (gap * current_mask).sum(),
            "tokens_current": current_mask.sum(),
            "tokens": trained.sum(),
            "is_weight_max": is_ratio.max() if is_ratio.numel() else torch.zeros(()),
        }
    return loss, sums
