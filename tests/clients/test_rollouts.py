"""The rollout record, trajectory assembly, the torn-tail tolerance and pass@k (no servers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from clients.summary import pass_at_k
from sciproto.client.rollouts import (
    RolloutRecord,
    RolloutStatus,
    TokenDriftError,
    Trajectory,
    drop_torn_tail,
    read_rollouts,
)
from sciproto.pb import common_pb2


def span(start: int, end: int, version: int) -> common_pb2.VersionSpan:
    return common_pb2.VersionSpan(start=start, end=end, policy_version=version)


def test_turns_extend_the_trajectory_and_spans_move_to_trajectory_indices() -> None:
    trajectory = Trajectory()
    trajectory.add_turn([1, 2, 3], [4, 5], [-0.5, -0.25], [span(0, 2, 7)])
    trajectory.add_turn([1, 2, 3, 4, 5, 6, 7], [8], [-1.0], [span(0, 1, 8)])
    assert trajectory.token_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    assert trajectory.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert trajectory.logprobs == [0, 0, 0, -0.5, -0.25, 0, 0, -1.0]
    assert trajectory.version_spans == [(3, 5, 7), (7, 8, 8)]
    assert (trajectory.counts.prompt, trajectory.counts.completion) == (5, 3)
    assert (trajectory.versions.min, trajectory.versions.max) == (7, 8)


def test_a_prompt_that_re_tokenized_the_previous_turn_is_refused() -> None:
    trajectory = Trajectory()
    trajectory.add_turn([1, 2], [3], [-0.1], [])
    with pytest.raises(TokenDriftError, match="index 1"):
        trajectory.add_turn([1, 9, 3, 4], [5], [-0.1], [])


def record(rollout_id: str, **fields) -> RolloutRecord:
    return RolloutRecord(rollout_id=rollout_id, group_id="toy/test/0", env="toy", split="test", index=0,
                         sample=0, **{"status": RolloutStatus.SCORED, **fields})


def test_records_refuse_misaligned_tokens_and_silent_infra_errors() -> None:
    with pytest.raises(ValueError, match="same length"):
        record("a", token_ids=[1, 2], loss_mask=[0], logprobs=[0.0, 0.0])
    with pytest.raises(ValueError, match="error"):
        record("a", status=RolloutStatus.INFRA_ERROR)


def test_a_torn_last_line_is_skipped_and_cut(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    first = record("toy/test/0/0").to_json_line()
    path.write_text(first + record("toy/test/0/1").to_json_line()[:40])
    assert [r.rollout_id for r in read_rollouts(path)] == ["toy/test/0/0"]
    drop_torn_tail(path, chunk_bytes=16)  # small chunks: the search crosses chunk borders
    assert path.read_text() == first


def test_pass_at_k_is_the_unbiased_estimator() -> None:
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(4, 3, 2) == 1.0
