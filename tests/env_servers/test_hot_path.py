"""What the hot path's shortcuts must not change: tools whose schemas are built once per class
are the tools Aviary builds per episode, each bound to its own episode; ToolSpecs converted once
are the same as converted afresh; long calculator expressions still leave the event loop."""

from __future__ import annotations

import asyncio
import json
import threading

from aviary.core import ToolCall, ToolRequestMessage
from aviary.envs.gsm8k import CalculatorEnv

from env_servers import convert
from env_servers.catalog import load_source
from env_servers.envs import gsm8k
from env_servers.envs.gsm8k import BoundedCalculatorEnv


def specs(tools: list) -> list[dict]:
    return [{"name": s.name, "description": s.description, "parameters": json.loads(s.parameters_json_schema)}
            for s in (convert._spec(tool.info) for tool in tools)]


async def test_cached_tools_are_the_tools_aviary_builds() -> None:
    _, aviary_tools = await CalculatorEnv(None, "What is 1 + 1?", 2.0).reset()
    _, first = await BoundedCalculatorEnv(None, "What is 1 + 1?", 2.0).reset()
    _, second = await BoundedCalculatorEnv(None, "What is 2 + 2?", 4.0).reset()
    assert specs(first) == specs(aviary_tools)
    assert [t.model_dump(by_alias=True) for t in first] == [t.model_dump(by_alias=True) for t in aviary_tools]
    assert first[0].info is second[0].info  # built once, shared
    assert convert.tools_to_proto(first) == convert.tools_to_proto(aviary_tools)


async def test_each_episode_s_tools_call_its_own_environment() -> None:
    source = load_source("gsm8k")
    envs = [await source.make("test", index) for index in (0, 1)]
    for env in envs:
        await env.reset()
    answers = [env.answer for env in envs]
    assert answers[0] != answers[1]
    submit = ToolRequestMessage(tool_calls=[ToolCall.from_name("submit_answer", answer=str(answers[0]))])
    (_, right, done_right, _), (_, wrong, done_wrong, _) = [await env.step(submit) for env in envs]
    assert (right, wrong) == (1.0, 0.0) and done_right and done_wrong


async def test_problems_are_the_ones_aviary_s_dataset_gives() -> None:
    from aviary.envs.gsm8k import GSM8kDataset

    dataset = GSM8kDataset("test", hf_source=str(gsm8k.DATA_DIR))
    source = load_source("gsm8k")
    for index in (0, 17, source.splits["test"] - 1):
        ours, theirs = await source.make("test", index), dataset.get_new_env_by_idx(index)
        assert (ours.problem_id, ours.problem, ours.answer) == (theirs.problem_id, theirs.problem, theirs.answer)
        assert ours.config == theirs.config


async def test_every_episode_runs_the_problem_its_summary_names() -> None:
    source = load_source("gsm8k")
    for split, size in source.splits.items():
        for index in range(size):
            env = await source.make(split, index)
            assert env.problem == source.task_summary(split, index)["question"], (split, index)


async def test_short_calls_run_on_the_loop_and_long_ones_on_a_thread() -> None:
    env = BoundedCalculatorEnv(None, "q", 1.0)
    await env.reset()
    threads: list[str] = []
    calculate = env.calculator

    def recording(expr: str) -> tuple[float | str, float, bool]:
        threads.append(threading.current_thread().name)
        return calculate(expr)

    env.tools = [gsm8k.cached_tool(calculate, run=gsm8k._on_the_loop_when_short(recording, "expr"))]
    short = "12 * 34 + 5"
    long = "+".join(["1"] * (gsm8k.INLINE_ARGUMENT_CHARS // 2 + 1))
    assert len(long) > gsm8k.INLINE_ARGUMENT_CHARS
    for expr in (short, long):
        (response,), _, done, _ = await env.step(
            ToolRequestMessage(tool_calls=[ToolCall.from_name("calculator", expr=expr)]))
        assert not done
        assert response.content == str(eval(expr))  # our own literal sums
    assert threads[0] == threading.current_thread().name
    assert threads[1] != threading.current_thread().name


async def test_an_overlong_expression_is_still_refused() -> None:
    env = BoundedCalculatorEnv(None, "q", 1.0)
    await env.reset()
    expr = "1+" * gsm8k.MAX_EXPRESSION_CHARS + "1"
    (response,), reward, done, _ = await env.step(
        ToolRequestMessage(tool_calls=[ToolCall.from_name("calculator", expr=expr)]))
    assert "characters; at most" in response.content
    assert reward == env.config.tool_failure_reward and done


def test_a_spec_is_converted_once_per_tool_info() -> None:
    env = BoundedCalculatorEnv(None, "q", 1.0)
    tools = asyncio.run(env.reset())[1]
    assert convert.tool_to_proto(tools[0]) is convert.tool_to_proto(tools[0])
    fresh = CalculatorEnv(None, "q", 1.0)
    fresh_tools = asyncio.run(fresh.reset())[1]
    assert convert.tool_to_proto(fresh_tools[0]) == convert.tool_to_proto(tools[0])


def test_a_task_id_worked_out_once_is_the_digest_of_its_content() -> None:
    from env_servers.envs.source import content_id

    source = load_source("gsm8k")
    for split, index in [("test", 0), ("test", 5), ("train", 3), ("test", 0)]:
        assert source.task_id(split, index) == content_id("gsm8k", source._task_content(split, index))
    assert source.task_id("test", 0) != source.task_id("test", 1)
