"""Per-task statistics and the set-aside rule (clients.train.task_stats), with the task stream,
sink, ledger and flow they run in: real objects, no servers."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

from clients.curriculum import Curriculum
from clients.train.config import Budget, RolloutSettings
from clients.train.display import Progress, RunStatus
from clients.train.events import LearnerEvents
from clients.train.flow import FATES, Flow, GroupLedger
from clients.train.producers import GroupSink, TaskStream
from clients.train.records import TrainOutcome
from clients.train.stream import LearnerStream
from clients.train.task_stats import (
    TaskFilter,
    TaskRecord,
    TaskStats,
    TaskStatsFile,
    restore_task_stats,
)
from sciproto.client.rollouts import RolloutGroup, RolloutRecord, RolloutStatus, TaskKey
from sciproto.pb import learner_pb2
from sciproto.rundir import LEARNER_STATE_FILE, MANIFEST_FILE, TASK_STATS_FILE, checkpoint_dir


def group(index: int, rewards: list[float]) -> RolloutGroup:
    task = TaskKey("toy", "train", index)
    return RolloutGroup(task, [RolloutRecord(rollout_id=task.rollout_id(i), group_id=task.group_id, env="toy",
                                             split="train", index=index, sample=i, status=RolloutStatus.SCORED,
                                             reward=r) for i, r in enumerate(rewards)])


def checkpoint(run_dir: Path, step: int) -> None:
    """A complete checkpoint folder as far as the run directory's readers go (sciproto.rundir)."""
    folder = checkpoint_dir(run_dir, step)
    folder.mkdir(parents=True)
    (folder / MANIFEST_FILE).write_text("{}")
    (folder / LEARNER_STATE_FILE).write_text("{}")


def stream_of(stats: TaskStats, size: int, flow: Flow | None = None) -> TaskStream:
    return TaskStream("toy", "train", size, None, 0, {}, flow or Flow(10_000), RunStatus(batch_groups=1), stats)


async def take(stream: TaskStream, count: int) -> list[int]:
    tasks = stream.stream()
    return [(await anext(tasks)).index for _ in range(count)]


def test_a_task_is_set_aside_after_its_window_of_groups_without_signal_and_a_mixed_one_brings_it_back() -> None:
    stats = TaskStats(TaskFilter(window=2))
    task = TaskKey("toy", "train", 0)
    stats.record(group(0, [1.0, 1.0, 1.0]))
    assert stats.set_aside(task) is None, "one group is not a window"
    stats.record(group(0, [1.0, 1.0, 1.0]))
    assert stats.set_aside(task) == "solved"
    stats.record(group(0, [0.0, 1.0, 0.0]))
    assert stats.set_aside(task) is None
    stats.record(group(0, [0.0, 0.0]))
    stats.record(group(0, [0.0, 0.0]))
    assert stats.set_aside(task) == "unsolved"
    record = stats.tasks["toy/train/0"]
    assert (record.groups, record.samples, record.solved, record.above) == (5, 13, 7, 1)
    assert stats.summary() == {"tasks": 1, "groups": 5, "set_aside": 1, "set_aside_solved": 0,
                                "set_aside_unsolved": 1, "passed_over": 0, "revisited": 0,
                                "revisited_all_set_aside": 0, "revisits_mixed": 0}
    assert TaskStats(TaskFilter(enabled=False), stats.tasks).set_aside(task) is None


def test_a_set_aside_task_comes_back_now_and_then_and_a_stream_of_set_aside_tasks_never_stalls(caplog) -> None:
    stats = TaskStats(TaskFilter(window=1, revisit_prob=0.2))
    stats.record(group(0, [1.0, 1.0]))  # task 0 of 4: solved
    tasks = asyncio.run(take(stream_of(stats, 4), 400))
    counts = Counter(tasks)
    assert 0 < counts[0] < counts[1] / 2, counts  # revisited, at about a fifth of the others' rate
    assert stats.revisited == counts[0] and stats.passed_over > 0
    assert abs(stats.revisited + stats.passed_over - counts[1]) <= 1, "each turn of task 0 is counted once"
    assert stats.revisited_all_set_aside == 0 and "set aside" not in caplog.text

    # Every task set aside and no revisits asked for: the stream still refills (a whole cycle
    # passed over, then the next task is revisited) rather than wait for ever.
    none_back = TaskStats(TaskFilter(window=1, revisit_prob=0.0))
    for index in range(4):
        none_back.record(group(index, [0.0, 0.0]))
    assert sorted(set(asyncio.run(asyncio.wait_for(take(stream_of(none_back, 4), 8), 5)))) == [0, 1, 2, 3]
    assert none_back.summary()["set_aside"] == 4 and none_back.revisited == 8
    # ... and says once that the split has run out, counting the turns that came of it.
    assert none_back.summary()["revisited_all_set_aside"] == 8
    said = [r.getMessage() for r in caplog.records if "every task of" in r.getMessage()]
    assert said == [("every task of toy:train is set aside (its last 1 groups gave no signal): revisiting the most"
                     " promising; more tasks would give GRPO more to learn from")]


def test_a_revisit_generates_the_set_aside_task_most_likely_to_teach_and_counts_what_it_gave() -> None:
    stats = TaskStats(TaskFilter(window=1, revisit_prob=1.0))
    # Six tasks, all set aside by their last group: 0-2 were solved every time, 3 was mixed once
    # (3 of 8 solved), 4 unsolved every time, 5 was mixed twice (4 of 10). Task 6 is not set aside.
    for index in range(3):
        stats.record(group(index, [1.0, 1.0, 1.0, 1.0]))
    stats.record(group(3, [1.0, 0.0, 0.0, 0.0]))
    stats.record(group(3, [1.0, 1.0, 0.0, 0.0]))
    stats.record(group(3, [0.0, 0.0, 0.0, 0.0]))
    stats.record(group(4, [0.0, 0.0, 0.0, 0.0]))
    stats.record(group(5, [1.0, 0.0, 1.0, 0.0]))
    stats.record(group(5, [1.0, 1.0, 0.0, 0.0]))
    stats.record(group(5, [0.0, 0.0]))
    assert sorted(stats.aside) == [f"toy/train/{i}" for i in range(6)]
    promise = {i: stats.tasks[f"toy/train/{i}"].promise() for i in range(6)}
    assert promise[5] > promise[3] > promise[4] == promise[0], promise  # p = 2.5/7, 2.25/9, 1/6, 5/6

    tasks = stream_of(stats, 7)
    # Task 0's turn: 5 is the most promising; with 5 in flight, 3; with both, the rest tie with
    # task 0, whose turn it is. Task 6 is not set aside: its own turn, never a revisit.
    assert tasks.turn(TaskKey("toy", "train", 0), 0).index == 5
    assert tasks.turn(TaskKey("toy", "train", 1), 0).index == 3
    assert tasks.turn(TaskKey("toy", "train", 0), 0).index == 0
    assert tasks.turn(TaskKey("toy", "train", 6), 0).index == 6
    assert stats.revisited == 3 and stats.generating == {"toy/train/5", "toy/train/3", "toy/train/0", "toy/train/6"}
    # The revisits' groups come back: one mixed (5), one not (3); a group of a task handed out in its
    # own turn (6) is no revisit.
    stats.record(group(5, [1.0, 0.0]))
    stats.record(group(3, [0.0, 0.0]))
    stats.record(group(6, [1.0, 0.0]))
    assert stats.revisits_mixed == 1 and stats.summary()["revisits_mixed"] == 1
    assert stats.generating == {"toy/train/0"} and stats.revisiting == {"toy/train/0"}
    assert stats.snapshot()["revisits_mixed"] == 1

    # A curriculum's stream revisits only the curriculum's tasks; `in_turn` revisits the task at hand.
    curriculum = TaskStream("toy", "train", 7, [0, 1, 3], 0, {}, Flow(100), RunStatus(batch_groups=1), stats)
    assert curriculum.turn(TaskKey("toy", "train", 1), 0).index == 3
    in_turn = TaskStats(TaskFilter(window=1, revisit_prob=1.0, revisit="in_turn"), stats.tasks)
    assert stream_of(in_turn, 7).turn(TaskKey("toy", "train", 1), 0).index == 1


def test_a_task_mixed_long_ago_and_all_right_since_stops_being_the_most_promising() -> None:
    once = TaskRecord()
    once.add("solved", 6, 6, 0)  # all right at its only visit
    lately = TaskRecord()
    lately.add("mixed", 6, 3, 3)
    for turn, ahead in enumerate([True, True, False]):
        lately.add("solved", 6, 6, 0)
        assert (lately.promise() > once.promise()) is ahead, (turn, lately.promise(), once.promise())
    # Eleven groups about half solved, then four all right: the policy that solved half is gone.
    long_ago = TaskRecord()
    for _ in range(11):
        long_ago.add("mixed", 6, 3, 3)
    for _ in range(4):
        long_ago.add("solved", 6, 6, 0)
    assert long_ago.promise() < once.promise(), (long_ago.promise(), once.promise())
    # The weighted counts survive a snapshot; one written before them counts every sample alike.
    again = TaskRecord.from_json(json.loads(json.dumps(long_ago.to_json())))
    assert again.promise() == long_ago.promise()
    older = {k: v for k, v in once.to_json().items() if not k.startswith("weighted")}
    assert TaskRecord.from_json(older).promise() == once.promise()


def test_the_statistics_of_a_checkpoints_step_survive_a_resume_exactly(tmp_path: Path) -> None:
    stats = TaskStats()
    for index, rewards in enumerate([[1.0, 1.0], [0.0, 0.5, 1.0], [0.0, 0.0], [0.25, 0.25]] * 3):
        stats.record(group(index % 5, rewards))
    stats.passed_over, stats.revisited, stats.revisited_all_set_aside, stats.revisits_mixed = 3, 2, 1, 1
    snapshots = TaskStatsFile(tmp_path, checkpoint_every=10)
    snapshots.save(stats, 10)
    at_10 = json.loads(json.dumps(stats.snapshot()))
    checkpoint(tmp_path, 10)
    stats.record(group(7, [1.0, 0.0]))  # after the checkpoint: gone with a crash before the next
    snapshots.save(stats, 11)
    snapshots.save(stats, 12)
    steps = [s["step"] for s in json.loads((tmp_path / TASK_STATS_FILE).read_text())["snapshots"]]
    assert steps == [10, 12], "the checkpoint's snapshot and the newest are kept"

    restored = TaskStats()
    assert restore_task_stats(restored, tmp_path) == 10
    assert restored.snapshot() == at_10 and "toy/train/7" not in restored.tasks
    assert restored.summary() == {**stats.summary(), "tasks": 5, "groups": 12}

    # A final checkpoint of a step the client never heard of (it finished after the stream
    # ended) restores the newest snapshot before it.
    checkpoint(tmp_path, 13)
    again = TaskStats()
    assert restore_task_stats(again, tmp_path) == 12 and again.snapshot() == stats.snapshot()
    assert restore_task_stats(TaskStats(), tmp_path / "elsewhere") is None

    # A resumed run opens the file again and keeps from it what a resume may still need.
    TaskStatsFile(tmp_path, checkpoint_every=10).save(stats, 14)
    steps = [s["step"] for s in json.loads((tmp_path / TASK_STATS_FILE).read_text())["snapshots"]]
    assert steps == [12, 14]


def test_a_curriculum_seeds_the_statistics() -> None:
    stats = TaskStats(TaskFilter(window=1))
    stats.seed(Curriculum(env="toy", split="train", indices=[3, 4], pass_rates={"3": 0.0, "4": 0.5, "5": 1.0},
                          samples=8))
    assert stats.set_aside(TaskKey("toy", "train", 3)) == "unsolved"
    assert stats.set_aside(TaskKey("toy", "train", 4)) is None
    assert stats.set_aside(TaskKey("toy", "train", 5)) == "solved"
    assert stats.tasks["toy/train/4"].solved == 4


def test_the_ledger_settles_every_group_once_while_tasks_are_set_aside(tmp_path: Path) -> None:
    """Tasks pass through the filtered stream, the sink and the learner's events (receipts and
    step results as a learner sends them): nothing lost, nothing counted twice."""

    async def run() -> tuple[Flow, GroupLedger, TrainOutcome, TaskStats, RunStatus]:
        flow, ledger = Flow(8), GroupLedger()
        status, outcome = RunStatus(batch_groups=2), TrainOutcome(run_dir=str(tmp_path))
        learner = LearnerStream("unused:1", ledger, status, 1.0)
        events = LearnerEvents(Budget(), flow, ledger, status, outcome, learner, asyncio.Event(), 0.0,
                               lambda *_: None)
        stats = TaskStats(TaskFilter(window=1, revisit_prob=0.1))
        tasks = stream_of(stats, 6, flow)
        with (tmp_path / "r.jsonl").open("w") as rollouts, (tmp_path / "f.jsonl").open("w") as failures:
            sink = GroupSink(RolloutSettings(), learner, flow, status, outcome, rollouts, failures, stats)
            stream, accepted = tasks.stream(), []
            for _ in range(60):
                task = await anext(stream)
                # Even tasks are all solved; odd ones mixed.
                made = group(task.index, [1.0, 1.0] if task.index % 2 == 0 else [1.0, 0.0])
                sink.deliver(made, tasks.next_epoch(task))
                group_id = next(reversed(ledger.unsettled))  # the group just sent
                if made.rollouts[0].reward == made.rollouts[1].reward:
                    await events.handle(learner_pb2.TrainStepResponse(receipt=learner_pb2.GroupReceipt(
                        group_id=group_id, accepted=False, reason="no_signal")))
                    continue
                await events.handle(learner_pb2.TrainStepResponse(receipt=learner_pb2.GroupReceipt(
                    group_id=group_id, accepted=True)))
                accepted.append(group_id)
                if len(accepted) == 2:
                    await events.handle(learner_pb2.TrainStepResponse(step=learner_pb2.OptimizerStepResult(
                        step=len(outcome.steps) + 1, consumed_group_ids=accepted)))
                    accepted = []
        events.settle()
        outcome.task_stats = stats.summary()
        return flow, ledger, outcome, stats, status

    flow, ledger, outcome, stats, status = asyncio.run(run())
    assert outcome.groups_generated == 60 == len(ledger.fates) == stats.summary()["groups"]
    assert all(len(fates) <= 1 for fates in ledger.fates.values()), "a group settled twice"
    assert set(ledger.counts) <= set(FATES)
    assert ledger.settled + len(ledger.unsettled) == 60 and flow.started == 60
    assert flow.consumed == ledger.settled and flow.in_flight == 0
    # Solved tasks were set aside after their first group and came back only now and then.
    assert ledger.counts["skipped_equal"] < 60 / 4 and stats.passed_over > 0
    assert outcome.task_stats["set_aside"] == outcome.task_stats["set_aside_solved"] == 3
    assert status.tasks_set_aside == 3
    assert Progress(None, enabled=False).postfix(status, 1.0)["set_aside"] == 3
