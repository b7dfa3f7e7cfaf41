"""`sciproto eval`'s tool-use figures: the share of replies holding a well-formed tool call (the
policy server parsed it into tool_calls; a malformed block stays in the text) and calls per episode."""

from __future__ import annotations

from clients.eval_report import analyse_pass
from sciproto.client.rollouts import MessageRecord, RolloutRecord, RolloutStatus, ToolCallRecord


def _record(index: int, replies: list[MessageRecord], reward: float) -> RolloutRecord:
    messages = [MessageRecord(role="user", content="2 + 3?")]
    for reply in replies:
        messages += [reply, MessageRecord(role="tool", content="5")]
    return RolloutRecord(rollout_id=f"gsm8k/test/{index}/0", group_id=f"gsm8k/test/{index}", env="gsm8k",
                         split="test", index=index, sample=0, status=RolloutStatus.SCORED, reward=reward,
                         steps=len(replies), messages=messages)


def _call(name: str, arguments: str) -> MessageRecord:
    return MessageRecord(role="assistant", tool_calls=[ToolCallRecord(id="c", name=name, arguments=arguments)])


def test_tool_use_counts_well_formed_calls_per_reply_and_episode() -> None:
    records = [
        _record(0, [_call("calculator", '{"expr": "2+3"}'), _call("submit_answer", '{"answer": "5"}')], 1.0),
        _record(1, [MessageRecord(role="assistant", content='<tool_call>{"name": calc</tool_call>')], 0.0),
        _record(2, [MessageRecord(role="assistant", content="The answer is 5."), _call("submit_answer", '{"answer": "6"}')],
                0.0),
    ]
    report = analyse_pass("greedy", records, temperature=0.0, samples=1, seed=None, max_steps=4, max_tokens=512,
                          success_reward=1.0, wall_s=1.0)
    assert report.tool_call_reply_frac == round(3 / 5, 4)
    assert (report.tool_calls.mean, report.tool_calls.max) == (1.0, 2)
    assert report.tool_calls_by_name == {"calculator": 1, "submit_answer": 2}
