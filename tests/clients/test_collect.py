"""Collection against real env and policy server processes: the line format, resuming,
cancellation, and env replicas that share the load or die mid-run."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from clients.agent import env_pool, policy_pool
from clients.collect import (
    CollectConfig,
    CollectError,
    collect,
    main,
    output_paths,
    run_collection,
    tasks_of,
)
from sciproto.client.env import EnvClient
from sciproto.client.retries import RetryPolicy
from sciproto.client.rollouts import RolloutRecord, RolloutStatus, read_rollouts
from sciproto.config import load_config
from sciproto.processes import sciproto_command
from tests.clients.conftest import FAST


async def env_counters(target: str):
    async with EnvClient(target) as client:
        return (await client.describe(timeout=10)).counters


def policy_runs(mask: list[int]) -> int:
    """Number of maximal runs of policy tokens (mask 1)."""
    return sum(1 for i, m in enumerate(mask) if m == 1 and (i == 0 or mask[i - 1] == 0))


def assert_well_formed(record: RolloutRecord) -> None:
    n = len(record.token_ids)
    assert n and len(record.loss_mask) == n and len(record.logprobs) == n
    assert record.loss_mask[0] == 0, "a trajectory starts with prompt tokens"
    assert all(lp == 0.0 for lp, m in zip(record.logprobs, record.loss_mask) if m == 0)
    assert all(lp <= 0.0 for lp, m in zip(record.logprobs, record.loss_mask) if m == 1)
    covered = sorted(i for start, end, _ in record.version_spans for i in range(start, end))
    assert covered == [i for i, m in enumerate(record.loss_mask) if m == 1], "version spans cover policy tokens"
    assert record.tokens.completion == sum(record.loss_mask)
    assert record.tokens.prompt + record.tokens.completion == n
    assistant_turns = [m for m in record.messages if m.role == "assistant"]
    # Every turn's tokens extend the previous turn's: one run of policy tokens per assistant turn,
    # separated by environment tokens.
    assert policy_runs(record.loss_mask) == len(assistant_turns) == record.steps


def test_gsm8k_collection_writes_valid_lines(tmp_path: Path, env_server, policy_server) -> None:
    output = tmp_path / "gsm8k.jsonl"
    summary = main(env=[env_server.target], policy=[policy_server.target], tasks="gsm8k:test", output=output,
                   limit=3, samples=2, concurrency=4, overrides=FAST)
    lines = output.read_text().splitlines()
    records = [RolloutRecord.model_validate(json.loads(line)) for line in lines]
    assert sorted(r.rollout_id for r in records) == [f"gsm8k/test/{i}/{s}" for i in range(3) for s in range(2)]
    for record in records:
        assert json.loads(record.to_json_line())["schema"] == "sciproto.rollout/1"
        # Episodes that end without an answer are graded as wrong answers, not left unscored.
        assert record.status is RolloutStatus.SCORED and record.error is None
        assert record.task["question"] and record.messages[0].role in ("system", "user")
        assert_well_formed(record)
    # The random model never calls a tool, so gsm8k asks again: both turns are used.
    assert any(r.steps == 2 for r in records)
    # The two samples of a group share the first turn's prompt, token for token.
    by_group = {}
    for record in records:
        first_policy_token = record.loss_mask.index(1)
        by_group.setdefault(record.group_id, set()).add(tuple(record.token_ids[:first_policy_token]))
    assert all(len(prompts) == 1 for prompts in by_group.values())
    failures, summary_path = output_paths(output)
    assert failures.read_text() == ""
    assert json.loads(summary_path.read_text())["rollouts"] == summary.rollouts == 6
    assert summary.tokens["completion"] == sum(r.tokens.completion for r in records)


def test_an_unbounded_split_needs_a_limit(tmp_path: Path, env_server, policy_server) -> None:
    output = tmp_path / "dummy.jsonl"
    with pytest.raises(CollectError, match="unbounded.*--limit"):
        main(env=[env_server.target], policy=[policy_server.target], tasks="dummy:default", output=output,
             overrides=FAST)
    summary = main(env=[env_server.target], policy=[policy_server.target], tasks="dummy:default", output=output,
                   limit=2, overrides=FAST)
    assert summary.rollouts == 2
    assert sorted(r.rollout_id for r in read_rollouts(output)) == ["dummy/default/0/0", "dummy/default/1/0"]


def test_killed_collection_resumes_without_duplicates_or_losses(tmp_path: Path, env_server, policy_server) -> None:
    output = tmp_path / "toy.jsonl"
    args = ["collect", "--env", env_server.target, "--policy", policy_server.target, "--tasks", "toy:test",
            "--limit", "10", "--samples", "2", "--concurrency", "2", "--output", str(output),
            *(arg for override in FAST for arg in ("--set", override))]
    process = subprocess.Popen(sciproto_command(*args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (output.exists() and len(output.read_text().splitlines()) >= 4):
            assert process.poll() is None, "collect ended before it could be interrupted"
            assert time.monotonic() < deadline, "collect wrote nothing within 120 s"
            time.sleep(0.05)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
    before = len(list(read_rollouts(output)))
    assert 4 <= before < 20
    with output.open("a") as file:
        file.write('{"schema": "sciproto.rollout/1", "rollout_id": "toy/te')  # a write cut short by a crash

    main(env=[env_server.target], policy=[policy_server.target], tasks="toy:test", output=output, limit=10,
         samples=2, concurrency=4, overrides=FAST)
    ids = [record.rollout_id for record in read_rollouts(output)]
    assert Counter(ids) == Counter(f"toy/test/{i}/{s}" for i in range(10) for s in range(2))
    assert output.read_text().endswith("\n")


async def test_cancelled_collection_closes_its_episodes(env_server, policy_server) -> None:
    config = load_config(CollectConfig, None, FAST)
    pulled = 0

    def tasks():
        nonlocal pulled
        for task in tasks_of("toy", "test", 64):
            pulled += 1
            yield task

    groups = []
    # Earlier tests' killed collect process left its episodes open (until the idle TTL).
    live_before = (await env_counters(env_server.target)).live_episodes
    async with env_pool([env_server.target]) as env, policy_pool([policy_server.target]) as policy:
        stream = collect(tasks(), env=env, policy=policy, samples=2, concurrency=6, sampling=config.sampling,
                         max_steps=config.max_steps)
        async for group in stream:
            # Admission control: tasks are pulled only when a group slot (6 // 2 = 3) is free.
            assert pulled - len(groups) <= 3
            groups.append(group)
            if len(groups) == 2:
                break
        await stream.aclose()
        assert all(replica.load == 0 for replica in env.replicas)
    assert pulled < 64
    assert all(len(g.rollouts) == 2 and g.complete for g in groups)
    assert (await env_counters(env_server.target)).live_episodes == live_before


async def test_a_closed_env_pool_has_ended_its_streams_and_the_server_closed_their_episodes(spawn_env) -> None:
    """Leaving env_pool ends each replica's Session stream as the protocol says, and waits for it:
    the server closes the episodes opened on it before the stream ends, so a call made right
    after the pool is closed finds them closed (a cancelled stream would leave that to a race)."""
    server = await asyncio.to_thread(spawn_env)
    async with EnvClient(server.target) as watcher:
        await watcher.describe(timeout=10)  # connected before the first pool closes
        for _ in range(40):
            async with env_pool([server.target]) as env:
                client = env.replicas[0].client
                await asyncio.gather(*(client.reset("toy", split="test", index=i) for i in range(10)))
            assert (await watcher.describe(timeout=10)).counters.live_episodes == 0


async def test_two_env_replicas_share_the_load_and_survive_one_killed(spawn_env, policy_server) -> None:
    first, second = await asyncio.gather(asyncio.to_thread(spawn_env), asyncio.to_thread(spawn_env))
    config = load_config(CollectConfig, None, FAST)
    seen: list[RolloutRecord] = []
    async with env_pool([first.target, second.target], wait_for_healthy_s=5) as env, \
            policy_pool([policy_server.target]) as policy:
        async for group in collect(tasks_of("toy", "test", 16), env=env, policy=policy, samples=2, concurrency=8,
                                   sampling=config.sampling, max_steps=config.max_steps,
                                   retries=RetryPolicy(attempts=2, episode_restarts=2)):
            seen += group.rollouts
            if len(seen) == 4:
                opened = [(await env_counters(s.target)).episodes_opened for s in (first, second)]
                assert all(count > 0 for count in opened), f"both replicas take episodes: {opened}"
                second.kill()
        assert not env.replicas[1].healthy and env.replicas[1].failures >= 1
    ids = Counter(r.rollout_id for r in seen)
    assert ids == Counter(f"toy/test/{i}/{s}" for i in range(16) for s in range(2))
    for record in seen:
        assert record.status is RolloutStatus.SCORED or (record.status is RolloutStatus.INFRA_ERROR and record.error)
    # Episodes caught on the dead replica start again from Reset on the live one.
    assert sum(r.status is RolloutStatus.SCORED for r in seen) >= len(seen) - 8


async def test_only_env_replica_killed_gives_infra_errors_not_a_hang(tmp_path: Path, spawn_env, policy_server) -> None:
    server = spawn_env()
    output = tmp_path / "toy.jsonl"
    overrides = [*FAST, "replicas.wait_for_healthy_s=1", "retries.attempts=2", "retries.episode_restarts=1"]
    config = load_config(CollectConfig, None, overrides)

    async def kill_after_first_lines() -> None:
        while not (output.exists() and output.read_text().count("\n") >= 2):
            await asyncio.sleep(0.05)
        server.kill()

    killer = asyncio.create_task(kill_after_first_lines())
    async with asyncio.timeout(180):
        summary = await run_collection([server.target], [policy_server.target], "toy:test", output, 12, 2, 4, config)
    await killer
    failures_path, _ = output_paths(output)
    written, failed = list(read_rollouts(output)), list(read_rollouts(failures_path))
    ids = Counter(r.rollout_id for r in written + failed)
    assert ids == Counter(f"toy/test/{i}/{s}" for i in range(12) for s in range(2)), "each rollout exactly once"
    assert failed and summary.infra_errors == len(failed)
    assert all(r.status is RolloutStatus.INFRA_ERROR and r.error and r.reward == 0.0 for r in failed)
    assert all(r.status is not RolloutStatus.INFRA_ERROR for r in written)


async def test_replica_rejoins_when_its_health_check_passes(spawn_env) -> None:
    from tests.clients.conftest import free_port

    port = free_port()
    server = spawn_env(port)
    async with env_pool([server.target], probe_interval_s=0.1, probe_max_interval_s=0.5, wait_for_healthy_s=60) as pool:
        replica = pool.replicas[0]
        server.kill()
        pool.mark_down(replica, RuntimeError("killed by the test"))
        assert pool.healthy() == []
        await asyncio.sleep(0.5)
        assert not replica.healthy, "a dead server must not pass the health probe"
        spawn_env(port)
        async with asyncio.timeout(60), pool.lease() as leased:
            assert leased is replica and replica.healthy
            assert (await leased.client.describe(timeout=10)).environments


def test_collection_where_every_rollout_failed_exits_non_zero(tmp_path: Path, env_server, policy_server) -> None:
    # A Generate deadline no call can meet: every rollout is an INFRA_ERROR.
    output = tmp_path / "failed.jsonl"
    result = subprocess.run(
        sciproto_command("collect", "--env", env_server.target, "--policy", policy_server.target,
                         "--tasks", "gsm8k:test", "--limit", "2", "--output", str(output),
                         "--set", "deadlines.generate_s=0.0001", "--set", "retries.attempts=1",
                         "--set", "retries.episode_restarts=0", "--set", "progress=false"),
        capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "no rollout succeeded: all 2 failed" in result.stderr
    assert "Traceback" not in result.stderr
    assert len(output_paths(output)[0].read_text().splitlines()) == 2
    # A rerun with nothing left to do, or one where some rollouts succeed, exits 0.
    fine = subprocess.run(
        sciproto_command("collect", "--env", env_server.target, "--policy", policy_server.target,
                         "--tasks", "gsm8k:test", "--limit", "2", "--output", str(output), "--set", "progress=false"),
        capture_output=True, text=True, timeout=300, check=False)
    assert fine.returncode == 0, fine.stderr[-2000:]


def test_summary_rollout_files_are_compact_and_the_viewer_reads_them(tmp_path: Path, env_server,
                                                                        policy_server) -> None:
    from tests.clients.test_viewer import Viewer

    files = {}
    for detail in ("full", "summary"):
        files[detail] = tmp_path / f"{detail}.jsonl"
        summary = main(env=[env_server.target], policy=[policy_server.target], tasks="gsm8k:test",
                       output=files[detail], limit=2, samples=2, overrides=[*FAST, f"rollouts={detail}"])
        assert summary.rollouts == 4
    full, compact = (sorted(read_rollouts(files[d]), key=lambda r: r.rollout_id) for d in ("full", "summary"))
    assert [r.rollout_id for r in full] == [r.rollout_id for r in compact]
    for record in compact:
        assert record.detail == "summary" and record.token_ids == record.logprobs == record.loss_mask == []
        assert record.tokens.completion > 0 and record.messages, "counts and transcript are kept"
    assert all(r.detail == "full" and r.token_ids for r in full)
    full_size, compact_size = (files[d].stat().st_size for d in ("full", "summary"))
    assert compact_size * 2 < full_size, (compact_size, full_size)
    viewer = Viewer(files["summary"])
    try:
        status, page = viewer.get("/api/rollouts?offset=0")
        assert status == 200 and page["total"] == 4 and all(row["completion_tokens"] > 0 for row in page["rows"])
        status, record = viewer.get("/api/rollout?key=rollouts:1")
        assert status == 200 and record["detail"] == "summary" and record["messages"]
    finally:
        assert viewer.stop() == 0
