"""The rollout client's ledger and stall display: what it concludes from the learner's events."""

from __future__ import annotations

from collections import Counter

import pytest

from clients.train.display import Progress, RunStatus, stall_cause
from clients.train.flow import GroupLedger
from clients.train.records import TrainOutcome
from sciproto.pb import common_pb2, learner_pb2


def request(group_id: str) -> learner_pb2.TrainStepRequest:
    return learner_pb2.TrainStepRequest(group=learner_pb2.RolloutGroup(group_id=group_id))


def receipt(group_id: str, reason: str = "", detail: str = "") -> learner_pb2.GroupReceipt:
    return learner_pb2.GroupReceipt(group_id=group_id, accepted=not reason, reason=reason,
                                    detail=detail)


def test_each_group_is_settled_once_by_receipts_and_step_results() -> None:
    ledger = GroupLedger()
    for name in ("a", "b", "c", "d", "e"):
        ledger.add(request(name))
    assert ledger.on_receipt(receipt("a")) == (0, False)
    assert ledger.on_receipt(receipt("b", "stale")) == (1, False)
    assert ledger.on_receipt(receipt("c", "busy")) == (0, True)  # send again later
    assert ledger.on_receipt(receipt("d", "no_signal")) == (1, False)
    step = learner_pb2.OptimizerStepResult(consumed_group_ids=["a"], dropped_stale_group_ids=["e"])
    assert ledger.on_step(step) == 2
    assert ledger.on_step(step) == 0  # named again: not counted again, but recorded
    assert ledger.counts == Counter(consumed=1, refused_stale=1, skipped_equal=1, dropped_stale=1)
    assert list(ledger.unsettled) == ["c"]
    assert ledger.fates["a"] == ["consumed", "consumed"], "a second fate is kept for checks"


def test_a_new_stream_resends_what_the_learner_never_settled() -> None:
    ledger = GroupLedger()
    for name in ("a", "b"):
        ledger.add(request(name))
    ledger.sent.update({"a", "b"})
    ledger.on_receipt(receipt("a"))
    again = [r.group.group_id for r in ledger.to_resend()]
    assert again == ["a", "b"] and ledger.resent == 2 and not ledger.accepted
    # The restarted learner had trained "a" before its checkpoint.
    assert ledger.on_receipt(receipt("a", "duplicate", "consumed")) == (1, False)
    assert ledger.counts == Counter(consumed=1)


def test_a_failed_step_keeps_returned_groups_and_settles_abandoned_ones() -> None:
    ledger = GroupLedger()
    for name in ("a", "b"):
        ledger.add(request(name))
    failure = learner_pb2.StepFailure(returned_group_ids=["a"], abandoned_group_ids=["b"])
    assert ledger.on_step_failure(failure) == 1
    assert list(ledger.unsettled) == ["a"] and ledger.counts == Counter(abandoned=1)


def test_the_stall_notice_names_all_equal_groups_and_what_is_missing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status = RunStatus(batch_groups=16, started=0.0, rollouts_finished=80, groups_in_learner=3,
                       since_step=Counter(skipped_equal=10))
    progress = Progress(total=30, enabled=False, stall_after_s=30)
    assert progress.tick(status, now=10.0) is None
    notice = progress.tick(status, now=31.0)
    assert notice is not None and notice.startswith("no optimizer step for 31 s: waiting for 13")
    assert "10 groups all-equal" in notice and "answers alike" in notice
    assert notice in capsys.readouterr().err
    assert progress.tick(status, now=40.0) is None, "the same cause is not repeated at once"
    status.learner_down_since = 35.0
    assert "learner is unreachable since 5 s" in (progress.tick(status, now=40.0) or "")


def test_groups_with_signal_since_the_last_step_keep_the_notice_from_saying_the_policy_answers_alike() -> None:
    # Seen in a run: "2 of a batch of 4 in the learner; since the last step 2 groups all-equal ...;
    # every group since the last step was all-equal" while the 2 the learner held had signal.
    ledger = GroupLedger()
    for name in ("a", "b", "c", "d"):
        ledger.add(request(name))
    ledger.on_step(learner_pb2.OptimizerStepResult())
    for name in ("a", "b"):
        ledger.on_receipt(receipt(name))
    for name in ("c", "d"):
        ledger.on_receipt(receipt(name, "no_signal"))
    status = RunStatus(batch_groups=4, started=0.0, rollouts_finished=24, groups_in_learner=2,
                       since_step=ledger.since_step)
    cause = stall_cause(status, now=60.0)
    assert "2 groups all-equal" in cause and "answers alike" not in cause, cause
    ledger.on_receipt(receipt("a"))  # a receipt repeated (a resent copy) counts once
    assert ledger.since_step["accepted"] == 2


def test_one_all_equal_group_is_not_called_a_policy_that_answers_alike() -> None:
    # Seen as the first notice of a GRPO phase after SFT: "since the last step 1 groups all-equal
    # (no signal), ...; every group since the last step was all-equal: the policy answers alike".
    status = RunStatus(batch_groups=4, started=0.0, rollouts_finished=6, since_step=Counter(skipped_equal=1))
    cause = stall_cause(status, now=121.0)
    assert "1 group all-equal" in cause and "answers alike" not in cause, cause
    status.since_step = Counter(skipped_equal=3)
    assert "3 groups all-equal" in stall_cause(status, now=121.0)
    assert "every group since the last step was all-equal: the policy answers alike" in stall_cause(status, 121.0)


def test_the_notice_of_all_equal_groups_tells_solved_tasks_from_a_stuck_policy() -> None:
    # Run 5's last half hour solved nearly every task and read "the policy answers alike", the words
    # of a policy stuck on wrong answers; the groups' common reward tells the two apart.
    def group(name: str, reward: float) -> learner_pb2.TrainStepRequest:
        scored = common_pb2.REWARD_STATUS_SCORED
        rollouts = [learner_pb2.Rollout(sample_index=i, reward=common_pb2.Reward(value=reward, status=scored))
                    for i in range(4)]
        return learner_pb2.TrainStepRequest(group=learner_pb2.RolloutGroup(group_id=name, rollouts=rollouts))

    ledger = GroupLedger()
    for name in ("a", "b", "c"):
        ledger.add(group(name, 1.0))
        ledger.on_receipt(receipt(name, "no_signal"))
    status = RunStatus(batch_groups=4, started=0.0, rollouts_finished=12, since_step=ledger.since_step,
                       equal_rewards=ledger.equal_rewards)
    cause = stall_cause(status, now=121.0)
    assert "answers alike: every sample scored 1 in 3 groups" in cause, cause
    ledger.add(group("d", 0.0))
    ledger.on_receipt(receipt("d", "no_signal"))
    cause = stall_cause(status, now=121.0)
    assert "answers alike: every sample scored 1 in 3 groups, 0 in 1 group" in cause, cause
    # A graded reward (the demo's toy env) gave a real run "0 in 320 groups, 0.03 in 2 groups, 0.042
    # in 21 groups, ..." eleven rewards long: the notice names the three most common, and the rest.
    for i in range(8):
        ledger.add(group(f"graded{i}", 0.01 * (i + 1)))
        ledger.on_receipt(receipt(f"graded{i}", "no_signal"))
    cause = stall_cause(status, now=121.0)
    assert cause.endswith("every sample scored 1 in 3 groups, 0 in 1 group, 0.01 in 1 group, and 7 groups at"
                          " 7 other rewards"), cause
    ledger.on_step(learner_pb2.OptimizerStepResult())
    assert not ledger.equal_rewards, "counted since the last step"


def test_the_shared_reward_is_that_of_the_scored_samples() -> None:
    # The learner finds no signal in a group whose scored samples agree, or that has fewer than two
    # scored: an unscored sample (an episode cut short) carries reward 0 and is no "scored 0".
    def rollout(reward: float, status: int) -> learner_pb2.Rollout:
        return learner_pb2.Rollout(reward=common_pb2.Reward(value=reward, status=status))

    scored, unscored = common_pb2.REWARD_STATUS_SCORED, common_pb2.REWARD_STATUS_UNSCORED
    groups = {"cut-first": [rollout(0.0, unscored), rollout(1.0, scored), rollout(1.0, scored)],
              "one-scored": [rollout(0.0, unscored), rollout(0.0, unscored), rollout(1.0, scored)]}
    ledger = GroupLedger()
    for name, rollouts in groups.items():
        ledger.add(learner_pb2.TrainStepRequest(group=learner_pb2.RolloutGroup(group_id=name, rollouts=rollouts)))
        ledger.on_receipt(receipt(name, "no_signal"))
    status = RunStatus(batch_groups=1, started=0.0, rollouts_finished=6, since_step=Counter(skipped_equal=3),
                       equal_rewards=ledger.equal_rewards)
    assert ledger.equal_rewards == Counter({1.0: 1, None: 1}), ledger.equal_rewards
    assert stall_cause(status, now=61.0).split("answers alike: ")[1].startswith(
        "every sample scored 1 in 1 group, fewer than two scored in 1 group"), stall_cause(status, now=61.0)


def test_the_live_line_gives_generation_speed_from_when_generation_began() -> None:
    # A run whose sft phase took its first 11 minutes showed tok_s=6 while generating 20 a second.
    status = RunStatus(batch_groups=4, started=0.0, completion_tokens=2000)
    assert Progress(total=None, enabled=False).postfix(status, now=100.0)["tok_s"] == "20"
    status.generating_since = 660.0
    assert Progress(total=None, enabled=False).postfix(status, now=760.0)["tok_s"] == "20"


def test_the_live_line_shows_each_phases_own_figures() -> None:
    # An hour's tool-use run read "phase=grpo, sft_loss=0.185, reward=nan" for its first GRPO
    # minutes, and kept showing the sft phase's last loss to the end, as if it were current.
    status = RunStatus(batch_groups=4, started=0.0, step=2, first_step_s=15.0, phase="sft", sft_loss=0.21)
    line = Progress(total=None, enabled=False).postfix(status, now=60.0)
    assert line["sft_loss"] == "0.210" and "reward" not in line
    status.phase = "grpo"  # the sft phase has ended; no GRPO step yet
    line = Progress(total=None, enabled=False).postfix(status, now=90.0)
    assert "sft_loss" not in line and "reward" not in line and line["version"] == 0
    status.step, status.reward_mean = 3, 0.5
    line = Progress(total=None, enabled=False).postfix(status, now=120.0)
    assert line["reward"] == "0.500" and "sft_loss" not in line


def test_the_summarys_tokens_per_s_counts_from_when_rollouts_began() -> None:
    # The hour-long tool-use run's summary averaged its GRPO phase's tokens over the 11 minutes
    # of SFT before it as well.
    outcome = TrainOutcome(run_dir="run", seconds=3600.0, sft_seconds=660.0, completion_tokens=58_800)
    assert outcome.tokens_per_s == 20.0
    assert TrainOutcome(run_dir="run", seconds=30.0, sft_seconds=30.0).tokens_per_s == 0.0  # sft only


def test_the_live_line_shows_progress_from_the_start_and_the_time_budget_left() -> None:
    status = RunStatus(batch_groups=4, started=100.0, rollouts_finished=40)
    line = Progress(total=200, enabled=False, max_seconds=1800).postfix(status, now=119.0)
    assert line["rollouts"] == 40 and line["waiting_first_step"] == "19s" and line["time_left"] == "29:41"
    status.step, status.first_step_s, status.reward_mean = 3, 67.0, 0.5
    line = Progress(total=None, enabled=False).postfix(status, now=2000.0)
    assert line["first_step"] == "67s" and line["reward"] == "0.500" and "time_left" not in line
    assert Progress(total=None, enabled=False, max_seconds=60).postfix(status, now=2000.0)["time_left"] == "0:00"


def test_a_time_budget_keeps_the_step_budgets_time_estimate_off_the_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Seen at the end of an hour's run with budget.max_steps 400: "38/400 [59:44<27:33:12,
    # 274.01s/step, ..., time_left=0:16]": the estimate to step 400 when the run ends in 16 s.
    status = RunStatus(batch_groups=4, started=0.0, rollouts_finished=500, step=38, first_step_s=31.0,
                       reward_mean=0.542)
    timed = Progress(total=400, enabled=True, max_seconds=3600)
    timed.tick(status, now=3584.0)
    timed.close()
    line = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert "38/400" in line and "time_left=0:16" in line and "<" not in line, line
    steps_only = Progress(total=400, enabled=True)
    steps_only.tick(status, now=3584.0)
    steps_only.close()
    line = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert "38/400" in line and "<" in line, line  # the step budget binds: its estimate is the one


def test_a_full_batch_in_the_learner_reads_as_a_step_in_progress() -> None:
    status = RunStatus(batch_groups=4, started=0.0, groups_in_learner=4)
    assert "a step is training" in stall_cause(status, now=100.0)


def test_the_summary_gives_the_reward_of_the_first_and_last_steps_as_means() -> None:
    """One step's batch reward is a few groups' worth: the summary compares means of 5 steps."""
    from rich.console import Console

    from clients.train import StepRecord, TrainOutcome, print_summary

    rewards = [0.4, 0.1, 0.2, 0.3, 0.0, 0.5, 0.9, 0.6, 0.7, 0.8, 0.3, 0.5]
    steps = [StepRecord(step=i + 1, policy_version=i + 1, reward_mean=r, policy_lag_mean=1.0, groups=4,
                        seconds=10.0 * i) for i, r in enumerate(rewards)]
    console = Console(record=True, width=120)
    print_summary(TrainOutcome(run_dir="runs/x", steps=steps), console)
    text = console.export_text()
    assert "reward, first -> last 5 steps" in text and "0.200 -> 0.580" in text, text
    console = Console(record=True, width=120)
    print_summary(TrainOutcome(run_dir="runs/x", steps=steps[:1]), console)
    assert "reward, first -> last 1 step " in console.export_text()
