"""`sciproto train`'s rollout client against real env, policy and learner processes that fail:
a policy server SIGKILLed and restarted, a learner SIGKILLed with groups in its buffer and
restarted, a step that fails, two TrainStep streams. The run goes on to its budget, and every
group generated is accounted exactly once."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from server_output import wait_for_line

from clients.train import StepRecord, TrainConfig, TrainOutcome, run_rollouts_into_learner
from sciproto.channel import make_channel
from sciproto.client.policy import PolicyClient
from sciproto.pb import learner_grpc, learner_pb2
from sciproto.processes import ServerProcess, start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

BATCH = 4
SAMPLES = 4
RUN_TIMEOUT_S = 240.0  # a run of a few tiny steps; bounds every test below
BOUND_S = 60.0  # longest a restarted policy server may serve old weights
HELD_STEP = 3  # the learner killed with groups in flight stops after training this step


def client_config(tasks: str, max_steps: int, staleness: int) -> TrainConfig:
    return TrainConfig.model_validate({
        "env": {"envs": ["toy"]},
        "learner": {"batch_groups": BATCH, "buffer_capacity": 2 * BATCH,
                    "grpo": {"max_staleness": staleness}},
        "budget": {"max_steps": max_steps, "max_seconds": None},
        "rollout": {"tasks": tasks, "samples": SAMPLES, "concurrency": 16, "max_steps": 1,
                    "sampling": {"max_tokens": 8},
                    "retries": {"attempts": 2, "initial_backoff_s": 0.2, "episode_restarts": 0},
                    # A Generate in flight when its server is SIGKILLed can hang until this
                    # deadline (300 s by default): fit it to the test's budget.
                    "deadlines": {"generate_s": 15},
                    "learner_reconnect_s": 120},
        "progress": False,
    })


def write_learner_config(path: Path, policy: ServerProcess, run_dir: Path, staleness: int,
                         **extra: object) -> Path:
    path.write_text(yaml.safe_dump({"learner": {
        "model": "tiny", "batch_groups": BATCH, "buffer_capacity": 2 * BATCH,
        "policy_targets": [policy.target], "run_dir": str(run_dir), "checkpoint_every": 1,
        "reconcile_interval_s": 1.0, "grpo": {"lr": 5e-3, "max_staleness": staleness}, **extra,
    }}))
    return path


def serve(component: str, *args: str, port: int = 0) -> ServerProcess:
    return start_server(["serve", component, *args, "--port", str(port)])


@pytest.fixture(autouse=True)
def client_dirs(tmp_path: Path) -> None:
    for name in ("client", "a", "b"):
        (tmp_path / name).mkdir()


@pytest.fixture
def env() -> Iterator[ServerProcess]:
    server = serve("env", "--env", "toy")
    yield server
    server.stop()


@pytest.fixture
def policy() -> Iterator[ServerProcess]:
    server = serve("policy", "--model", "tiny")
    yield server
    server.stop()


def restart_in_place(server: ServerProcess, *args: str) -> None:
    """Start `server`'s command again on the same port (after a kill)."""
    fresh = serve(server.component, *args, port=server.port)
    server.process, server.output = fresh.process, fresh.output


async def learner_version(target: str) -> int:
    async with make_channel(target) as channel:
        described = await learner_grpc.LearnerServiceStub(channel).Describe(
            learner_pb2.LearnerServiceDescribeRequest(), timeout=10)
    return described.policy_version


async def policy_version(target: str) -> int | None:
    try:
        async with PolicyClient(target) as client:
            return (await client.describe(timeout_s=5)).policy_version
    except Exception:  # noqa: BLE001 - down or starting
        return None


@pytest.mark.parametrize("staleness", [0, 1])
async def test_a_policy_server_killed_and_restarted_mid_run_gets_the_latest_weights(
    env: ServerProcess, policy: ServerProcess, tmp_path: Path, staleness: int
) -> None:
    learner = start_server(["serve", "learner", "--config", str(write_learner_config(
        tmp_path / "learner.yaml", policy, tmp_path / "run", staleness)), "--port", "0"])
    restarted_at: list[float] = []
    steps_after_restart: list[int] = []

    async def kill_and_restart() -> None:
        policy.kill()
        await asyncio.to_thread(restart_in_place, policy, "--model", "tiny")
        restarted_at.append(time.monotonic())

    killer: list[asyncio.Task[None]] = []

    def on_step(record: StepRecord, outcome: TrainOutcome) -> None:
        if record.step == 2 and not killer:
            killer.append(asyncio.ensure_future(kill_and_restart()))
        if restarted_at:
            steps_after_restart.append(record.step)

    try:
        config = client_config("toy:train", max_steps=6, staleness=staleness)
        outcome = await asyncio.wait_for(run_rollouts_into_learner(
            config, env.target, policy.target, learner.target, tmp_path / "client",
            asyncio.Event(), on_step), RUN_TIMEOUT_S)
        await killer[0]
        assert outcome.stopped_by == "max_steps" and outcome.steps[-1].step >= 6
        assert steps_after_restart, "no step ran after the policy server came back"
        # The restarted server came back with base weights at version 0; the learner pushes
        # its current weights within a bounded time.
        latest = await learner_version(learner.target)
        while (serving := await policy_version(policy.target)) != latest:
            assert time.monotonic() - restarted_at[0] < BOUND_S, (
                f"restarted policy server serves {serving}, learner is at {latest}")
            await asyncio.sleep(0.5)
            latest = await learner_version(learner.target)
        assert "re-pushed version" in "\n".join(learner.output)
    except BaseException:
        print("learner output:\n" + "\n".join(list(learner.output)[-60:]))
        raise
    finally:
        learner.stop()


async def test_every_group_is_accounted_once_through_a_learner_crash_a_failed_step_and_two_streams(
    env: ServerProcess, policy: ServerProcess, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    steps = 8  # the budget of both clients
    # max_steps as `sciproto train` sets it from the budget: without it the learner may train a
    # step 9 on groups still buffered after both clients stopped at step 8, which no client hears
    # of (they count its groups pending) while metrics.jsonl counts them consumed.
    # The first learner stops after training step 3 (its groups trained, no client told), for the
    # test to SIGKILL it there; the one started in its place trains on from the step-2 checkpoint.
    learner_yaml = write_learner_config(tmp_path / "learner.yaml", policy, run_dir, 1, max_steps=steps,
                                        faults={"fail_step_attempts": [2], "hold_at": "after_train",
                                                "hold_step": HELD_STEP})
    restart_yaml = write_learner_config(tmp_path / "learner-restart.yaml", policy, run_dir, 1,
                                        faults={"fail_step_attempts": [2]}, max_steps=steps)
    learner = start_server(["serve", "learner", "--config", str(learner_yaml), "--port", "0"])
    port = learner.port
    killed_with: list[int] = []

    async def crash_when_held() -> None:
        """SIGKILL the learner once it holds groups no client has heard the fate of (the held
        step's), then start it again."""
        await wait_for_line(learner, f"holding at after_train of step {HELD_STEP}", RUN_TIMEOUT_S / 2)
        async with make_channel(learner.target) as channel:
            state = await learner_grpc.LearnerServiceStub(channel).Describe(
                learner_pb2.LearnerServiceDescribeRequest(), timeout=10)
        buffer = state.buffer  # received, less what was refused on arrival or trained before step 3
        killed_with.append(buffer.groups_received - buffer.groups_dropped_stale - buffer.groups_skipped_equal
                           - BATCH * (HELD_STEP - 1))
        learner.kill()
        fresh = await asyncio.to_thread(start_server, [
            "serve", "learner", "--config", str(restart_yaml), "--port", str(port)])
        learner.process, learner.output = fresh.process, fresh.output

    try:
        crash = asyncio.ensure_future(crash_when_held())
        outcomes = await asyncio.wait_for(asyncio.gather(*(
            run_rollouts_into_learner(client_config(tasks, steps, 1), env.target, policy.target,
                                      learner.target, tmp_path / name, asyncio.Event())
            for tasks, name in (("toy:train", "a"), ("toy:test", "b"))
        )), RUN_TIMEOUT_S)
        await crash
    finally:
        learner.stop()
    assert killed_with and killed_with[0] >= BATCH, killed_with  # at least the held step's groups
    totals: collections.Counter[str] = collections.Counter()
    for outcome in outcomes:
        assert outcome.stopped_by == "max_steps"
        fates = outcome.group_fates  # group id -> list of every fate the client recorded
        assert len(fates) == outcome.groups_generated
        twice = {g: f for g, f in fates.items() if len(f) != 1}
        assert not twice, f"groups accounted more than once or never: {twice}"
        counted = collections.Counter(f[0] for f in fates.values())
        assert set(counted) <= {"consumed", "dropped_stale", "refused_stale", "skipped_equal",
                                "refused_invalid", "pending"}, counted
        assert counted == collections.Counter(
            {**outcome.groups_settled, "pending": outcome.groups_pending})
        totals.update(counted)
    assert sum(o.groups_resent for o in outcomes) >= 1, "the restarted learner got the lost groups"
    assert any(o.step_failures for o in outcomes), "the injected step failure reached a client"
    # Every consumed or dropped group is in exactly one metrics line, and the lines agree with
    # both clients together; arrival refusals after the last step have no line yet.
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(s["groups_consumed"] for s in lines) == totals["consumed"]
    assert sum(s["groups_dropped_stale"] for s in lines) == totals["dropped_stale"]
    for key, fate in (("groups_refused_stale", "refused_stale"),
                      ("groups_skipped_equal", "skipped_equal"),
                      ("groups_refused_invalid", "refused_invalid")):
        assert sum(s[key] for s in lines) <= totals[fate]


def run_cli(*overrides: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "sciproto", "train", "--config", "demo"]
    for override in overrides:
        command += ["--set", override]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    try:
        out, err = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)  # stops its servers too, unlike SIGKILL
        out, err = process.communicate(timeout=180)
        pytest.fail(f"sciproto train ran past {timeout_s:.0f} s:\n{err[-3000:]}")
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def test_push_every_beyond_max_staleness_plus_one_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    # A refusal takes seconds (imports); the bound is for a loaded machine, where it took over 60.
    done = run_cli(f"run.dir={tmp_path}", "learner.push_every=3", "budget.max_seconds=5",
                   timeout_s=240)
    assert done.returncode != 0
    assert "push_every (3) > max_staleness + 1 (2)" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "demo").exists(), "nothing may start for a refused config"


def test_a_stalled_run_says_why(tmp_path: Path) -> None:
    """Greedy sampling: every sample of a group is the same reply with the same reward, so no
    group carries signal and no step can run; the run must say so, not sit silent."""
    done = run_cli(f"run.dir={tmp_path}", "rollout.sampling.temperature=0",
                   "budget.max_seconds=25", "display.stall_after_s=5", "progress=false",
                   timeout_s=240)
    assert done.returncode == 0, done.stderr[-3000:]
    stalled = [line for line in done.stderr.splitlines() if "no optimizer step for" in line]
    assert stalled, done.stderr[-3000:]
    assert "all-equal" in stalled[0], stalled
    # ...and with the reward those groups share, so a stuck policy reads apart from solved tasks.
    assert any(re.search(r"answers alike: every sample scored -?[\d.]+ in \d+ groups?", line) for line in stalled), stalled
    # A run that made no step saves no checkpoint of the unchanged base model.
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert summary["steps"] == [] and summary["checkpoint"] == ""
    assert not list((tmp_path / "demo" / "checkpoints").glob("step_*"))
