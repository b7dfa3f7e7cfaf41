"""Which demonstrations a resumed run still sends (clients.train.phases.sft_groups): those its
learner has not trained, and never more than the sft phase has steps left, even when the
demonstrations file was written again in another order since (`sciproto demonstrate` writes its
records as their episodes finish)."""

from __future__ import annotations

from pathlib import Path

from clients.train.phases import Phase, sft_groups
from sciproto.client.rollouts import RolloutRecord, RolloutStatus

BATCH_GROUPS = 2


def _write(path: Path, indices: list[int]) -> None:
    lines = []
    for index in indices:
        record = RolloutRecord(rollout_id=f"toy/train/{index}/0", group_id=f"toy/train/{index}", env="toy",
                               split="train", index=index, sample=0, status=RolloutStatus.SCORED, reward=1.0,
                               token_ids=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0.0, 0.0, 0.0])
        lines.append(record.model_dump_json(by_alias=True) + "\n")
    path.write_text("".join(lines))


def test_a_rerun_sends_only_the_groups_left(tmp_path: Path) -> None:
    demos = tmp_path / "demos.jsonl"
    _write(demos, list(range(6)))
    phases = [Phase(objective="sft", demonstrations=demos, steps=2), Phase(objective="grpo")]
    first = sft_groups(phases, BATCH_GROUPS)
    assert len(first) == 4
    left = sft_groups(phases, BATCH_GROUPS, trained=[g.group_id for g in first[:2]])
    assert [g.group_id for g in left] == [g.group_id for g in first[2:]]


def test_a_finished_phase_sends_nothing_after_its_file_was_written_again_in_another_order(tmp_path: Path) -> None:
    demos = tmp_path / "demos.jsonl"
    _write(demos, list(range(6)))
    phases = [Phase(objective="sft", demonstrations=demos, steps=2), Phase(objective="grpo")]
    trained = [g.group_id for g in sft_groups(phases, BATCH_GROUPS)]  # the whole phase: 2 steps
    _write(demos, [5, 4, 3, 2, 1, 0])
    assert sft_groups(phases, BATCH_GROUPS, trained) == []
    # Half way through: the other half of the phase's groups, whatever the order.
    assert len(sft_groups(phases, BATCH_GROUPS, trained[:2])) == 2
