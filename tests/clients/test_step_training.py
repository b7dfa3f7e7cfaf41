"""Step-level groups as training data (rollout.grouping: step): a step group reaches the learner as
one group, its prompt shared by its n completions; the flow control and a resumed run count its
groups exactly; the config refuses bounds that cannot work."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from clients.agent import AgentSettings, Sampling, env_pool, policy_pool
from clients.collect import collect
from clients.step_groups import StepGrouping
from clients.step_rollouts import run_step_task
from clients.train import TrainConfig, group_to_pb, with_epoch
from clients.train.flow import Flow
from clients.train.resume import ResumePoint, resume_point
from learner.config import GRPOConfig
from learner.grpo import pad_right, prepare_batch
from learner.prefix import shared_prefix_length
from learner.service import group_from_pb
from sciproto.client.retries import Deadlines, RetryPolicy
from sciproto.client.rollouts import TaskKey
from sciproto.config import ConfigError
from sciproto.processes import ServerProcess, start_server
from tests.conftest import NOTEBOOK_SANDBOX
from tests.env_servers.conftest import wait_for_live_episodes


def test_a_resumed_run_counts_each_task_epoch_once_whatever_its_step_groups() -> None:
    trained = ["nb/train/0#0/step0", "nb/train/0#0/step1", "nb/train/0#0/step2", "nb/train/1#0/step0",
               "nb/train/0#1/step0"]
    point = resume_point(trained, "nb", "train", size=4)
    assert point == ResumePoint(start=3, epochs={TaskKey("nb", "train", 0): 2, TaskKey("nb", "train", 1): 1},
                                trained=3)


async def test_a_task_of_several_step_groups_holds_one_place_until_its_groups_are_settled() -> None:
    flow = Flow(max_ahead=2)
    await flow.admit()
    await flow.admit()  # two tasks generating: no third
    await flow.task_finished(3)  # the first gave three step groups, none settled yet
    assert flow.in_flight == 1
    admitted = asyncio.ensure_future(flow.admit())
    await flow.consume(2)
    await asyncio.sleep(0.05)
    assert not admitted.done(), "one group of the first task is unsettled and the second task runs"
    await flow.task_finished(0)  # the second gave none: its place is free at once
    await asyncio.wait_for(admitted, 5)
    assert flow.in_flight == 1 and flow.started - flow.consumed == 2


@pytest.mark.parametrize("override, says", [
    ({"step_groups": {"group_size": 4, "fork_budget": 3}}, "cannot pay for one group"),
    ({"step_groups": {"group_size": 2, "fork_budget": 3, "scoring": "rollout"}}, "opens 4 forks"),
    ({"step_groups": {"group_size": 1}}, "group_size"),
    ({"grouping": "trajectory", "observation": "state"}, "needs rollout.grouping step"),
    ({"step_groups": {"scoring": "best"}}, "scoring"),
])
def test_the_config_refuses_step_group_bounds_that_cannot_work(override: dict, says: str) -> None:
    rollout = {"tasks": "notebook:train", "grouping": "step", **override}
    with pytest.raises((ValueError, ConfigError), match=says):
        TrainConfig.model_validate({"env": {"envs": ["notebook"]}, "rollout": rollout})


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[ServerProcess, ServerProcess]]:
    env = start_server(["serve", "env", "--port", "0", "--set", "envs=[gsm8k,notebook]",
                        "--set", f"env_options.notebook.sandbox={NOTEBOOK_SANDBOX}"], timeout_s=120)
    try:
        policy = start_server(["serve", "policy", "--model", "tiny", "--port", "0"])
    except BaseException:
        env.stop()
        raise
    yield env, policy
    policy.stop()
    env.stop()


async def test_a_step_group_reaches_the_learner_as_one_group_of_n_completions_of_one_prompt(
    servers: tuple[ServerProcess, ServerProcess],
) -> None:
    env_server, policy_server = servers
    settings = AgentSettings(Sampling(max_tokens=8, seed=3), max_steps=2, max_tokens=4096,
                             retries=RetryPolicy(), deadlines=Deadlines())
    grouping = StepGrouping(group_size=3, max_depth=2, fork_budget=6)
    async with env_pool([env_server.target]) as env, policy_pool([policy_server.target]) as policy:
        played = await run_step_task(TaskKey("gsm8k", "test", 0), env, policy, settings, grouping)
    assert played.error is None and played.groups
    assert played.stats.forks_opened == played.stats.forks_closed == 3 * len(played.groups)
    assert await wait_for_live_episodes(env_server.target, 0) == 0
    first = played.groups[0]
    assert first.group_id == "gsm8k/test/0/step0"
    assert [r.rollout_id for r in first.rollouts] == [f"gsm8k/test/0/step0/{i}" for i in range(3)]
    group_id, records = with_epoch(first, 5)
    assert [r.rollout_id for r in records] == [f"gsm8k/test/0#5/step0/{i}" for i in range(3)]
    assert group_id == "gsm8k/test/0#5/step0"
    message = group_to_pb(group_id, records)
    assert len(message.rollouts) == 3
    learner_group = group_from_pb(message, vocab_size=1 << 20)
    prompt = len(played.prompt_tokens) and played.prompt_tokens[0]
    for sample in learner_group.samples:
        assert sample.loss_mask[:prompt] == [0] * prompt and all(sample.loss_mask[prompt:])
    plan = prepare_batch([learner_group.model_copy(update={"samples": [
        s.model_copy(update={"reward": float(i)}) for i, s in enumerate(learner_group.samples)]})],
        GRPOConfig())
    assert [round(seq.advantage, 3) for seq in plan.sequences] == [-1.225, 0.0, 1.225]
    assert plan.turn_prompt_tokens == [prompt] * 3
    assert shared_prefix_length(pad_right(plan.sequences)) >= prompt, "the prompt runs once"


async def test_the_agent_resets_with_the_state_view_and_renders_each_turn_whole(
    servers: tuple[ServerProcess, ServerProcess],
) -> None:
    env_server, policy_server = servers
    async with env_pool([env_server.target]) as env, policy_pool([policy_server.target]) as policy:
        [group] = [group async for group in collect([TaskKey("notebook", "train", 0)], env=env, policy=policy,
                                                   samples=1, sampling=Sampling(max_tokens=8, seed=1), max_steps=2,
                                                   options={"observation": "state"})]
    [record] = group.rollouts
    # No previous_token_ids across a state-view turn: sent, the policy would refuse the second
    # turn (its messages hold no assistant message to continue from).
    assert record.error is None and record.steps == 2, record.error
    text = bytes(t for t in record.token_ids if t < 256).decode(errors="replace")
    assert text.count("Question:") == 2, "each turn's prompt is the whole state view, instruction included"
    assert "Your actions so far:" in record.messages[-1].content
    turns = sum(1 for a, b in zip([0, *record.loss_mask], record.loss_mask) if b and not a)
    assert turns == 2 and len(record.turn_finish_reasons) == 2


def test_the_documented_step_group_config_is_a_valid_config() -> None:
    import re
    from pathlib import Path

    import yaml

    page = (Path(__file__).resolve().parents[2] / "docs" / "concepts" / "groups.md").read_text()
    [block] = [b for b in re.findall(r"```yaml\n(.*?)```", page, re.DOTALL) if "grouping: step" in b]
    config = TrainConfig.model_validate({"env": {"envs": ["notebook"]}, **yaml.safe_load(block)})
    assert config.rollout.grouping == "step" and config.rollout.options == {"observation": "state"}
    assert config.rollout.step_groups.grouping().fork_budget == 32


def test_sciproto_collect_writes_step_groups_and_a_rerun_skips_the_tasks_it_has(
    servers: tuple[ServerProcess, ServerProcess], tmp_path,
) -> None:
    from clients.collect import main
    from sciproto.client.rollouts import read_rollouts

    env_server, policy_server = servers
    output = tmp_path / "steps.jsonl"
    overrides = ["grouping=step", "step_groups.group_size=2", "step_groups.max_depth=2", "step_groups.fork_budget=4",
                 "sampling.max_tokens=8", "progress=false"]
    main(env=[env_server.target], policy=[policy_server.target], tasks="gsm8k:test", output=output, limit=2,
         overrides=overrides)
    records = list(read_rollouts(output))
    groups = {r.group_id for r in records}
    assert {g.rsplit("/step", 1)[0] for g in groups} == {"gsm8k/test/0", "gsm8k/test/1"}
    assert all(sum(r.group_id == g for r in records) == 2 for g in groups)
    assert len({r.rollout_id for r in records}) == len(records)
    main(env=[env_server.target], policy=[policy_server.target], tasks="gsm8k:test", output=output, limit=2,
         overrides=overrides)
    assert len(list(read_rollouts(output))) == len(records), "a rerun plays no task it has step groups of"


async def test_step_grouping_on_an_environment_that_cannot_fork_is_refused_before_any_rollout(
    env_server: ServerProcess, tmp_path,
) -> None:
    from clients.train import run_rollouts_into_learner

    config = TrainConfig.model_validate({"env": {"envs": ["dummy"]}, "progress": False,
                                         "rollout": {"tasks": "dummy:default", "grouping": "step"}})
    with pytest.raises(ConfigError, match="cannot fork"):
        await asyncio.wait_for(run_rollouts_into_learner(config, env_server.target, "127.0.0.1:1", "127.0.0.1:1",
                                                         tmp_path, asyncio.Event()), 60)
