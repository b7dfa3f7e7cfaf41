"""`sciproto verify`: stored rollouts graded again through Verify of stored trajectories, against a
real env server; every disagreement is listed and makes the exit status 1."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pytest

from sciproto.client.env import EnvClient, tool_calls_action
from sciproto.client.rollouts import MessageRecord, RolloutRecord, RolloutStatus, status_from_pb
from sciproto.pb import common_pb2
from sciproto.processes import ServerProcess, sciproto_command
from tests.env_servers.answers import expected_answer


def _reply(text: str) -> common_pb2.ChatMessage:
    return common_pb2.ChatMessage(role=common_pb2.ROLE_ASSISTANT, content=text)


# (env, split, index, action): right and wrong answers, a tool call and plain text.
EPISODES = [
    ("toy", "train", 0, _reply("12345")),
    ("toy", "train", 1, _reply("12ab")),
    ("gsm8k", "test", 0, tool_calls_action(("submit_answer", {"answer": expected_answer("gsm8k", "test", 0)}))),
    ("gsm8k", "test", 1, tool_calls_action(("submit_answer", {"answer": "-1"}))),
]


async def _play(target: str) -> list[RolloutRecord]:
    """One live episode per EPISODES entry, recorded as `collect` records it."""
    records = []
    async with EnvClient(target, transport="unary") as client:
        for env, split, index, action in EPISODES:
            reset = await client.reset(env, split=split, index=index)
            step = await client.step(reset.episode_id, action)
            reward = (await client.verify(reset.episode_id)).reward
            await client.close(reset.episode_id)
            records.append(RolloutRecord(
                rollout_id=f"{env}/{split}/{index}/0", group_id=f"{env}/{split}/{index}", env=env, split=split,
                index=index, sample=0, status=status_from_pb(reward.status), reward=reward.value, steps=1,
                terminated=step.terminated,
                messages=[MessageRecord.from_pb(m) for m in [*reset.observations, action, *step.observations]]))
    return records


def _write(path: Path, records: list[RolloutRecord]) -> Path:
    path.write_text("".join(record.to_json_line() for record in records))
    return path


def _verify(path: Path, target: str, *options: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(sciproto_command("verify", str(path), "--env", target, *options),
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def played(env_server: ServerProcess) -> list[RolloutRecord]:
    records = asyncio.run(_play(env_server.target))
    assert [r.reward for r in records][2:] == [1.0, 0.0]  # gsm8k: one right, one wrong
    assert 0.0 < records[1].reward < 1.0
    return records


def test_rollouts_graded_as_stored_agree(env_server: ServerProcess, played: list[RolloutRecord],
                                         tmp_path: Path) -> None:
    failed = played[0].model_copy(update={"rollout_id": "toy/train/2/0", "index": 2, "status": RolloutStatus.INFRA_ERROR,
                                          "error": "the env server went away", "messages": []})
    done = _verify(_write(tmp_path / "rollouts.jsonl", [*played, failed]), env_server.target)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "5 rollouts" in done.stdout and "4 agree, 0 disagree, 0 not re-scored, 1 skipped" in done.stdout


def test_every_disagreement_is_reported_with_old_and_new_reward(env_server: ServerProcess,
                                                                played: list[RolloutRecord],
                                                                tmp_path: Path) -> None:
    # As if the grader had changed since: the stored grades of two rollouts differ from today's.
    changed = [played[0], played[1].model_copy(update={"reward": 0.9}), played[2],
               played[3].model_copy(update={"reward": 1.0})]
    path = _write(tmp_path / "rollouts.jsonl", changed)
    done = _verify(path, env_server.target)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "2 agree, 2 disagree" in done.stdout
    assert f"toy/train/1/0: stored SCORED 0.9, now SCORED {played[1].reward:g}" in done.stdout
    assert "gsm8k/test/1/0: stored SCORED 1, now SCORED 0" in done.stdout

    report = json.loads(_verify(path, env_server.target, "--json").stdout)
    assert report["disagreed"] == 2 and report["ok"] is False
    assert [(d["rollout_id"], d["old_reward"], d["new_reward"]) for d in report["disagreements"]] == [
        ("toy/train/1/0", 0.9, played[1].reward), ("gsm8k/test/1/0", 1.0, 0.0)]


def test_a_rollout_the_server_cannot_grade_is_named(env_server: ServerProcess, played: list[RolloutRecord],
                                                    tmp_path: Path) -> None:
    unknown = played[0].model_copy(update={"rollout_id": "toy/nosuch/0/0", "split": "nosuch"})
    done = _verify(_write(tmp_path / "rollouts.jsonl", [played[0], unknown]), env_server.target)
    assert done.returncode == 1
    assert "1 agree, 0 disagree, 1 not re-scored" in done.stdout
    assert "not re-scored  toy/nosuch/0/0: NOT_FOUND" in done.stdout


def test_bad_input_gets_a_short_error(played: list[RolloutRecord], tmp_path: Path) -> None:
    missing = _verify(tmp_path / "none.jsonl", "127.0.0.1:1")
    assert missing.returncode != 0 and "is not a file" in missing.stderr
    assert "Traceback" not in missing.stderr and len(missing.stderr.strip().splitlines()) <= 2

    (tmp_path / "bad.jsonl").write_text('{"rollout_id": "x"}\n')
    bad = _verify(tmp_path / "bad.jsonl", "127.0.0.1:1")
    assert bad.returncode != 0 and "bad.jsonl:1 is not a sciproto.rollout/1 record" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) <= 2, bad.stderr

    nobody = _verify(_write(tmp_path / "rollouts.jsonl", played), "127.0.0.1:1", "--timeout", "5")
    assert nobody.returncode != 0 and "Traceback" not in nobody.stderr, nobody.stderr
    assert len(nobody.stderr.strip().splitlines()) <= 2, nobody.stderr
