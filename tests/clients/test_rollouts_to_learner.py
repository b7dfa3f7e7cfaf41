"""Real episodes (env and policy server processes) into the learner's Rollout message and back into
the learner's TrainSample: each policy turn's finish reason and each Step's reward arrive."""

from __future__ import annotations

from pathlib import Path

from clients.collect import main
from clients.train import group_to_pb
from learner.service import group_from_pb
from sciproto.client.rollouts import read_rollouts
from sciproto.pb import policy_pb2
from tests.clients.conftest import FAST

MAX_TOKENS = 16  # FAST's sampling.max_tokens


def turn_lengths(mask: list[int]) -> list[int]:
    """Tokens of each maximal run of policy tokens (one run per policy turn)."""
    runs: list[int] = []
    for i, m in enumerate(mask):
        if m == 1:
            if i == 0 or mask[i - 1] == 0:
                runs.append(0)
            runs[-1] += 1
    return runs


def test_finish_reasons_and_step_rewards_reach_the_learner(tmp_path: Path, env_server, policy_server) -> None:
    output = tmp_path / "gsm8k.jsonl"
    main(env=[env_server.target], policy=[policy_server.target], tasks="gsm8k:test", output=output,
         limit=2, samples=2, concurrency=4, overrides=FAST)
    records = list(read_rollouts(output))
    assert len(records) == 4
    for record in records:
        lengths = turn_lengths(record.loss_mask)
        assert len(record.turn_finish_reasons) == len(lengths) == record.steps
        # The random model rambles: a turn shorter than its limit was stopped, and a turn cut by its
        # limit used every token. A turn of exactly MAX_TOKENS may still be "stop": a stop token or
        # string that lands on the last allowed token ends the turn by stopping, as in vLLM.
        for n, reason in zip(lengths, record.turn_finish_reasons, strict=True):
            assert reason == "stop" if n < MAX_TOKENS else reason in ("stop", "length"), (n, reason)
            assert n == MAX_TOKENS if reason == "length" else n <= MAX_TOKENS, (n, reason)
        # gsm8k rewards nothing before the answer: every Step's reward is 0, one per Step.
        assert record.step_rewards == [0.0] * record.steps
    assert any("length" in r.turn_finish_reasons for r in records)

    by_group: dict[str, list] = {}
    for record in records:
        by_group.setdefault(record.group_id, []).append(record)
    for group_id, group in by_group.items():
        message = group_to_pb(group_id, group)
        for record, rollout in zip(group, message.rollouts, strict=True):
            assert [policy_pb2.FinishReason.Name(r) for r in rollout.turn_finish_reasons] == [
                f"FINISH_REASON_{r.upper()}" for r in record.turn_finish_reasons]
            assert list(rollout.step_rewards) == record.step_rewards
        trained = group_from_pb(message, vocab_size=10**6)
        for record, sample in zip(group, trained.samples, strict=True):
            assert [r.value.lower() for r in sample.turn_finish_reasons] == record.turn_finish_reasons
            assert sample.cut_by_length == ("length" in record.turn_finish_reasons)
            assert sample.step_rewards == record.step_rewards
