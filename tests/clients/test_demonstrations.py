"""`sciproto demonstrate`: GSM8K's worked solutions played through a real env server as calculator
calls and a submission, in the policy model's own tokens. Every kept demonstration is graded 1.0
again from its stored trajectory, and its loss mask covers exactly the assistant's turns."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pytest

from policy_server.toolcalls import parse_completion
from sciproto.client.env import EnvClient
from sciproto.client.rollouts import RolloutRecord, read_rollouts
from sciproto.models.byte_tokenizer import build_byte_tokenizer
from sciproto.models.smollm2 import load_smollm2_tokenizer
from sciproto.pb import common_pb2, env_pb2
from sciproto.processes import ServerProcess, sciproto_command


def _demonstrate(target: str, output: Path, model: str, tasks: str, limit: int) -> dict[str, int]:
    done = subprocess.run(sciproto_command("demonstrate", "--env", target, "--model", model, "--tasks", tasks,
                                           "--output", str(output), "--limit", str(limit)),
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


async def _stored_grades(target: str, records: list[RolloutRecord]) -> list[common_pb2.Reward]:
    async with EnvClient(target, transport="unary") as client:
        return [(await client.verify(trajectory=env_pb2.StoredTrajectory(
            env=r.env, task_ref=env_pb2.TaskRef(split=r.split, index=r.index),
            messages=[m.to_pb() for m in r.messages]))).reward for r in records]


def _masked_spans(record: RolloutRecord) -> list[list[int]]:
    spans: list[list[int]] = []
    for token, bit, previous in zip(record.token_ids, record.loss_mask, [0, *record.loss_mask]):
        if bit and not previous:
            spans.append([])
        if bit:
            spans[-1].append(token)
    return spans


@pytest.mark.parametrize(("model", "tasks", "limit"), [("tiny", "gsm8k:test", 6), ("tiny", "gsm8k:short_train", 4),
                                                       ("smollm2", "gsm8k:test", 3)])
def test_kept_demonstrations_grade_1_and_mask_the_assistant_turns(env_server: ServerProcess, tmp_path: Path,
                                                                   model: str, tasks: str, limit: int) -> None:
    output = tmp_path / "demos.jsonl"
    summary = _demonstrate(env_server.target, output, model, tasks, limit)
    records = list(read_rollouts(output))
    assert summary["kept"] == len(records) == limit, summary  # every worked solution checks out
    assert [r.reward for r in records] == [1.0] * limit

    grades = asyncio.run(_stored_grades(env_server.target, records))
    assert [(g.status, g.value) for g in grades] == [(common_pb2.REWARD_STATUS_SCORED, 1.0)] * limit

    tokenizer = build_byte_tokenizer() if model == "tiny" else load_smollm2_tokenizer()
    for record in records:
        assistant = [m for m in record.messages if m.role == "assistant"]
        names = [call.name for m in assistant for call in m.tool_calls]
        # One calculator call per annotation of the worked solution, then the submission.
        assert names[-1] == "submit_answer" and set(names[:-1]) == {"calculator"} and len(names) >= 2
        spans = _masked_spans(record)
        assert len(spans) == len(assistant)  # one trainable span per assistant turn, nothing else
        for span, message in zip(spans, assistant):
            text = tokenizer.decode(span)
            assert text.endswith("<|im_end|>")
            parsed = parse_completion(text.removesuffix("<|im_end|>"))  # what the policy server would parse
            assert not parsed.malformed and parsed.content == ""
            assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == \
                   [(c.name, json.loads(c.arguments)) for c in message.tool_calls]
        # Everything unmasked is prompt or environment text: the assistant turns' text is the mask's.
        unmasked = tokenizer.decode([t for t, bit in zip(record.token_ids, record.loss_mask) if not bit])
        assert "<tool_call>" not in unmasked.split("<|im_start|>assistant\n", 1)[-1]
        assert record.tokens.completion == sum(map(len, spans))

    if model == "tiny" and tasks == "gsm8k:test":  # a rerun skips the tasks already written
        assert _demonstrate(env_server.target, output, model, tasks, limit)["skipped"] == limit
        assert len(list(read_rollouts(output))) == limit


def test_an_unknown_split_is_one_line_and_exit_2(env_server: ServerProcess, tmp_path: Path) -> None:
    done = subprocess.run(sciproto_command("demonstrate", "--env", env_server.target, "--model", "tiny",
                                           "--tasks", "gsm8k:nope", "--output", str(tmp_path / "d.jsonl")),
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and "no split gsm8k:nope" in done.stderr and "Traceback" not in done.stderr
