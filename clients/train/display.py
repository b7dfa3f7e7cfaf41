"""What `sciproto train` shows while it runs.

A live line (tqdm, when `progress` is on): optimizer steps, reward, policy lag, and from the
first second the rollouts and groups finished, generation tokens/s, and the time the first
optimizer step took. When no step has run for `display.stall_after_s` seconds, a line on stderr
says so and why (printed whether or not the live line is on, again when the cause changes or
each further `stall_after_s`):

    no optimizer step for 62 s: waiting for 5 more groups (11 of a batch of 16 in the learner;
    since the last step 40 groups all-equal (no signal), 0 refused stale); 12 groups generating
"""

from __future__ import annotations

import math
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

from tqdm import tqdm


@dataclass
class RunStatus:
    """What the rollout client knows about the run; the display reads it once a second."""

    batch_groups: int
    started: float = field(default_factory=time.monotonic)
    rollouts_finished: int = 0
    groups_finished: int = 0
    groups_generating: int = 0
    completion_tokens: int = 0
    # When rollouts began (after any sft phase); None: at the start. tok_s counts from here.
    generating_since: float | None = None
    step: int = 0
    policy_version: int = 0
    reward_mean: float = float("nan")
    policy_lag_mean: float = 0.0
    first_step_s: float | None = None  # seconds from the start to the first step result
    last_step_at: float | None = None
    groups_in_learner: int = 0  # accepted by the learner and not yet consumed or dropped
    since_step: Counter[str] = field(default_factory=Counter)  # fates since the last step
    # All-equal groups by the reward their scored samples share (None: fewer than two scored).
    equal_rewards: Counter[float | None] = field(default_factory=Counter)
    learner_down_since: float | None = None
    step_failures: int = 0
    # rollout.grouping step: forks opened and closed so far (None: trajectory groups).
    forks_opened: int | None = None
    forks_closed: int = 0
    # Phases (clients.train.phases): "sft" while demonstrations train, with the last step's loss.
    phase: str = ""
    sft_loss: float | None = None
    tasks_set_aside: int = 0  # tasks passed over for now (clients.train.task_stats)

    def tokens_per_s(self, now: float) -> float:
        since = self.started if self.generating_since is None else self.generating_since
        return self.completion_tokens / max(now - since, 1e-9)


# All-equal groups in a row, none with signal, before a notice says the policy answers alike: one
# or two are common in a healthy run (GRPO after SFT: 51 of 87 groups all right or all wrong).
ALIKE_AFTER = 3


def shared_rewards(equal_rewards: Counter[float | None], named: int = 3) -> str:
    """'1 in 3 groups, 0 in 1 group': the rewards all-equal groups shared, most common first; a
    graded reward's long tail is counted, not listed."""
    ranked = sorted(equal_rewards.items(), key=lambda item: (-item[1], item[0] is None, item[0] or 0.0))
    named = len(ranked) if len(ranked) <= named + 1 else named  # "and 1 groups at 1 other rewards" says less
    labels = {reward: "fewer than two scored" if reward is None else f"{reward:g}" for reward, _ in ranked}
    text = ", ".join(f"{labels[reward]} in {n} group{'' if n == 1 else 's'}" for reward, n in ranked[:named])
    rest = ranked[named:]
    if rest:
        text += f", and {sum(n for _, n in rest)} groups at {len(rest)} other rewards"
    return text


def stall_cause(status: RunStatus, now: float) -> str:
    """Why no optimizer step is running, as far as the rollout client can tell."""
    if status.learner_down_since is not None:
        return (
            f"the learner is unreachable since {now - status.learner_down_since:.0f} s; "
            "reconnecting, and its groups will be sent again"
        )
    since = status.since_step
    equal = since["skipped_equal"]
    refusals = (
        f"since the last step {equal} group{'' if equal == 1 else 's'} all-equal (no signal), "
        f"{since['refused_stale'] + since['dropped_stale']} stale"
    )
    if since["refused_invalid"]:
        refusals += f", {since['refused_invalid']} invalid (see the learner log)"
    if status.groups_in_learner >= status.batch_groups:
        return (
            f"the learner holds {status.groups_in_learner} groups, a full batch: a step is "
            f"training ({refusals})"
        )
    missing = status.batch_groups - status.groups_in_learner
    cause = (
        f"waiting for {missing} more groups ({status.groups_in_learner} of a batch of "
        f"{status.batch_groups} in the learner; {refusals})"
    )
    if equal >= ALIKE_AFTER and equal >= since.total() - since["consumed"]:
        cause += "; every group since the last step was all-equal: the policy answers alike"
        if status.equal_rewards:
            cause += ": every sample scored " + shared_rewards(status.equal_rewards)
    if status.groups_generating:
        cause += f"; {status.groups_generating} groups generating"
    if not status.rollouts_finished:
        cause += "; no rollout has finished yet"
    return cause


class Progress:
    """The live line and the stall notices."""

    def __init__(self, total: int | None, enabled: bool, stall_after_s: float = 60.0,
                 max_seconds: float | None = None) -> None:
        # tqdm's time estimate is to the step budget; with a time budget as well, the line shows
        # time_left instead (an hour's run with 400 steps allowed read "59:44<27:33:12").
        bar_format = ("{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}, {rate_fmt}{postfix}]"
                      if total is not None and max_seconds is not None else None)
        self.bar = tqdm(
            total=total, unit="step", disable=not enabled, dynamic_ncols=True, desc="train",
            bar_format=bar_format,
        )
        self.stall_after_s = stall_after_s
        self.max_seconds = max_seconds  # the time budget: the line says how much of it is left
        self._last_notice: tuple[list[str], float] | None = None

    def postfix(self, status: RunStatus, now: float) -> dict[str, object]:
        """What the live line shows after the step count."""
        postfix: dict[str, object] = {
            "rollouts": status.rollouts_finished,
            "tok_s": f"{status.tokens_per_s(now):.0f}",
        }
        if status.phase:
            postfix["phase"] = status.phase
        # Each phase shows its own figure: the loss while demonstrations train, then the reward
        # of the last GRPO step (none before the first one).
        if status.sft_loss is not None and status.phase == "sft":
            postfix["sft_loss"] = f"{status.sft_loss:.3f}"
        if status.step and not math.isnan(status.reward_mean):
            postfix["reward"] = f"{status.reward_mean:.3f}"
        if status.step:
            postfix |= {
                "lag": f"{status.policy_lag_mean:.2f}",
                "version": status.policy_version,
                "first_step": f"{status.first_step_s:.0f}s",
            }
        else:
            postfix["waiting_first_step"] = f"{now - status.started:.0f}s"
        if status.tasks_set_aside:
            postfix["set_aside"] = status.tasks_set_aside
        if status.forks_opened is not None:
            postfix["forks_open"] = status.forks_opened - status.forks_closed
        if self.max_seconds is not None:  # the step bar's own estimate knows only the step budget
            left = max(0, round(self.max_seconds - (now - status.started)))
            postfix["time_left"] = f"{left // 60}:{left % 60:02d}"
        return postfix

    def tick(self, status: RunStatus, now: float | None = None) -> str | None:
        """Refresh the line; returns the stall notice printed, if any."""
        now = time.monotonic() if now is None else now
        self.bar.update(status.step - self.bar.n)
        self.bar.set_postfix(self.postfix(status, now), refresh=True)
        quiet_since = status.last_step_at if status.last_step_at is not None else status.started
        if now - quiet_since < self.stall_after_s:
            self._last_notice = None
            return None
        cause = stall_cause(status, now)
        kind = cause.split(" ", 3)[:3]  # "waiting for N", "the learner is", ...: same kind, same words
        if self._last_notice is not None:
            last_kind, printed_at = self._last_notice
            if last_kind == kind and now - printed_at < self.stall_after_s:
                return None
        notice = f"no optimizer step for {now - quiet_since:.0f} s: {cause}"
        tqdm.write(notice, file=sys.stderr)
        self._last_notice = (kind, now)
        return notice

    def close(self) -> None:
        self.bar.close()


__all__ = ["Progress", "RunStatus", "stall_cause"]
