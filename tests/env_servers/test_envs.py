"""The built-in environments and the catalog, exercised on real Aviary environments and kernels."""

import json
import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before aviary imports litellm

import psutil
import pytest
from aviary.core import Message, ToolCall, ToolRequestMessage

from env_servers.catalog import (
    UNBOUNDED,
    RescoreUnsupportedError,
    builtin_names,
    load_source,
    reward_components,
)
from env_servers.envs.toy import DigitsTaskDataset
from tests.conftest import NOTEBOOK_SANDBOX
from tests.env_servers.answers import expected_answer


def call(tool: str, **arguments: object) -> ToolRequestMessage:
    return ToolRequestMessage(tool_calls=[ToolCall.from_name(tool, **arguments)])


def kernel_processes() -> list[psutil.Process]:
    """Jupyter kernels started by environments of this test process (the kernels themselves, not
    the bwrap processes of their sandboxes; not the pooled kernels of env servers that other
    tests' fixtures run as child processes: those live in their own server's scratch directory)."""
    scratch = f"sciproto-env-{os.getpid()}-"
    kernels = []
    for child in psutil.Process().children(recursive=True):
        try:
            line, name = " ".join(child.cmdline()), child.name()
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            continue  # exited (a zombie another test's process left unreaped): no running kernel
        if "ipykernel" in line and scratch in line and name != "bwrap":
            kernels.append(child)
    return kernels


# ---------------------------------------------------------------- gsm8k


async def test_gsm8k_data_loads_through_aviary_loader() -> None:
    source = load_source("gsm8k")
    assert source.splits == {"train": 250, "test": 60, "short_train": 400, "short_test": 100,
                             "short_text_train": 400, "short_text_test": 100}
    for split, size in source.splits.items():
        for index in range(size):
            env = await source.make(split, index)
            assert env.answer == float(expected_answer("gsm8k", split, index))
            assert set(source.task_summary(split, index)) == {"question"}


async def test_short_gsm8k_problems_are_one_step_graded_by_the_calculator_env(tmp_path) -> None:
    import importlib.util
    import shutil

    from env_servers.envs.gsm8k import DATA_DIR

    source = load_source("gsm8k")
    env = await source.make("short_test", 0)
    observations, _ = await env.reset()
    assert "submit_answer" in observations[0].content and "NUMBER" in observations[0].content
    _, reward, done, _ = await env.step(call("submit_answer", answer="NUMBER"))  # the placeholder copied
    assert (reward, done) == (-1.0, True)
    env = await source.make("short_test", 0)
    await env.reset()
    _, reward, done, _ = await env.step(call("submit_answer", answer=expected_answer("gsm8k", "short_test", 0)))
    assert (reward, done) == (1.0, True)
    rows = [json.loads(line) for line in (DATA_DIR / "short_train.jsonl").read_text().splitlines()]
    assert all(row["answer"].count("<<") == 1 for row in rows)  # one calculation each
    # The shipped files are exactly what the generator writes.
    shutil.copy(DATA_DIR / "generate_short.py", tmp_path / "generate_short.py")
    spec = importlib.util.spec_from_file_location("generate_short", tmp_path / "generate_short.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main()
    for name in ("short_train.jsonl", "short_test.jsonl", "short_text_train.jsonl", "short_text_test.jsonl"):
        assert (tmp_path / name).read_bytes() == (DATA_DIR / name).read_bytes()


async def test_short_text_problems_are_the_short_ones_answered_by_the_last_number_of_a_plain_reply() -> None:
    from aviary.core import Message

    source = load_source("gsm8k")
    tool_env, text_env = await source.make("short_test", 4), await source.make("short_text_test", 4)
    assert (tool_env.answer, tool_env.problem.split("?")[0]) == (text_env.answer, text_env.problem.split("?")[0])
    observations, tools = await text_env.reset()
    assert tools == [] and observations[0].content.endswith("Reply with the number only.")
    answer = expected_answer("gsm8k", "short_text_test", 4)

    async def graded(reply: str) -> tuple[float, bool]:
        env = await source.make("short_text_test", 4)
        await env.reset()
        _, reward, done, _ = await env.step(Message(role="assistant", content=reply))
        return reward, done

    assert await graded(f"First 3, then {answer}.") == (1.0, True)  # the last number is the answer
    assert await graded(f"{answer} apples, not 3.") == (0.0, True)
    assert await graded("I cannot tell.") == (0.0, True)  # no number: wrong, not a failed tool call
    assert await graded(f"It is {answer}.0") == (1.0, True)
    from env_servers.envs.gsm8k import last_number
    assert [last_number(t) for t in ("It is 1,250.", "-3 left", "7.5 each", "none")] == ["1250", "-3", "7.5", None]
    rescored, components = await source.rescore("short_text_test", 4, [*observations,
                                                Message(role="assistant", content=f"So {answer}.")])
    assert (rescored, components) == (1.0, {"correct": 1.0, "submitted": 1.0})
    assert (await source.rescore("short_text_test", 4, observations))[0] == 0.0
    twin = await source.fork(text_env)
    assert (await twin.step(Message(role="assistant", content=answer)))[1] == 1.0


async def test_gsm8k_episode_with_calculator_and_correct_submission() -> None:
    source = load_source("gsm8k")
    summary = source.task_summary("train", 0)
    env = await source.make("train", 0)
    observations, tools = await env.reset()
    assert observations[0].content == summary["question"]
    assert {tool.info.name for tool in tools} == {"calculator", "submit_answer"}

    observations, reward, done, _ = await env.step(call("calculator", expr="6 * 7"))
    assert (observations[0].content, reward, done) == ("42", 0.0, False)

    _, reward, done, _ = await env.step(call("submit_answer", answer=expected_answer("gsm8k", "train", 0)))
    assert (reward, done) == (1.0, True)
    await env.close()


async def test_gsm8k_wrong_and_malformed_submissions() -> None:
    source = load_source("gsm8k")
    wrong = str(float(expected_answer("gsm8k", "test", 5)) + 1)
    env = await source.make("test", 5)
    await env.reset()
    _, reward, done, _ = await env.step(call("submit_answer", answer=wrong))
    assert (reward, done) == (0.0, True)

    env = await source.make("test", 5)
    await env.reset()
    _, reward, done, _ = await env.step(call("submit_answer", answer="forty"))
    assert (reward, done) == (-1.0, True)


async def test_gsm8k_rescore_and_inline_tasks() -> None:
    source = load_source("gsm8k")
    answer = expected_answer("gsm8k", "train", 3)
    trajectory = [Message(content="question"), call("submit_answer", answer=answer)]
    assert await source.rescore("train", 3, trajectory) == (1.0, {"correct": 1.0, "submitted": 1.0})
    trajectory[-1] = call("submit_answer", answer=answer + "1")
    assert (await source.rescore("train", 3, trajectory))[0] == 0.0
    assert (await source.rescore("train", 3, trajectory[:1]))[1]["submitted"] == 0.0

    env = await source.make_inline({"question": "What is 2 + 3?", "answer": "2+3 = 5\n#### 5"})
    await env.reset()
    assert (await env.step(call("submit_answer", answer="5")))[1] == 1.0
    with pytest.raises(ValueError, match="missing"):
        await source.make_inline({"question": "What is 2 + 3?"})
    with pytest.raises(ValueError, match="must be a number"):
        await source.make_inline({"question": "What is 2 + 3?", "answer": "five"})


# ---------------------------------------------------------------- notebook


def printed_output(observation: Message) -> str:
    """The output block of the last cell in the notebook's markdown observation."""
    text = json.loads(observation.content)[0]["text"]
    return text.rsplit("```", 2)[-2].strip()


async def test_notebook_episode_runs_pandas_in_a_local_kernel() -> None:
    source = load_source("notebook", {"sandbox": NOTEBOOK_SANDBOX})
    index = next(
        i
        for i in range(source.splits["train"])
        if "stations.csv" in source.task_summary("train", i)["files"]
        and "Summit" in source.task_summary("train", i)["question"]
    )
    summary = source.task_summary("train", index)
    env = await source.make("train", index)
    observations, tools = await env.reset()
    assert summary["question"] in observations[0].content
    assert {tool.info.name for tool in tools} >= {"edit_cell", "submit_answer"}
    work_dir = env.state.work_dir
    assert sorted(p.name for p in work_dir.glob("*.csv")) == ["readings.csv", "stations.csv"]

    code = (
        "import pandas as pd\n"
        "m = pd.read_csv('readings.csv').merge(pd.read_csv('stations.csv'), on='station_id')\n"
        "print(round(m[m.name == 'Summit'].temp_c.mean(), 2))"
    )
    observations, reward, done, _ = await env.step(call("edit_cell", contents=code))
    assert (reward, done) == (0.0, False)
    computed = printed_output(observations[-1])
    assert "answer" not in summary
    assert computed == expected_answer("notebook", "train", index)
    assert len(kernel_processes()) == 1

    _, reward, done, _ = await env.step(call("submit_answer", answer=computed))
    assert (reward, done) == (1.0, True)
    assert reward_components(env) == {"correct": 1.0}

    await env.close()
    assert kernel_processes() == []
    assert not work_dir.exists()


async def test_notebook_wrong_answer_scores_zero_and_reset_keeps_one_kernel() -> None:
    source = load_source("notebook", {"sandbox": NOTEBOOK_SANDBOX})
    env = await source.make("test", 0)
    await env.reset()
    await env.reset()  # a second reset must replace, not leak, the first kernel
    assert len(kernel_processes()) == 1
    _, reward, done, _ = await env.step(call("submit_answer", answer="not the answer"))
    assert (reward, done) == (0.0, True)
    assert reward_components(env) == {"correct": 0.0}
    await env.close()
    assert kernel_processes() == []


async def test_notebook_answer_checks_and_rescore() -> None:
    source = load_source("notebook", {"sandbox": NOTEBOOK_SANDBOX})
    rounded = next(
        i
        for i in range(source.splits["train"])
        if "Round to 2 decimal places" in source.task_summary("train", i)["question"]
    )
    answer = float(expected_answer("notebook", "train", rounded))
    for submitted, expected in [(f"{answer + 0.004}", 1.0), (f"{answer + 0.05}", 0.0)]:
        trajectory = [call("submit_answer", answer=submitted)]
        assert (await source.rescore("train", rounded, trajectory))[0] == expected

    env = await source.make_inline({"question": "Which?", "answer": "Valley", "dataset": "weather"})
    assert env.task.is_correct(" valley ") and not env.task.is_correct("Ridge")
    with pytest.raises(ValueError, match="unknown notebook dataset"):
        await source.make_inline({"question": "q", "answer": "1", "dataset": "../gsm8k"})


# ---------------------------------------------------------------- toy


@pytest.mark.parametrize(
    ("action", "expected"),
    [
        (Message(role="assistant", content="1234"), 1.0),
        (Message(role="assistant", content="12ab"), 0.5),
        (Message(role="assistant", content=""), 0.0),
        (call("submit_answer", answer="7 apples"), 1 / 8),
        (call("no_such_tool", answer="77"), 0.0),
    ],
)
async def test_toy_reward_is_the_digit_fraction_of_the_reply(
    action: Message, expected: float
) -> None:
    source = load_source("toy")
    env = await source.make("train", 7)
    observations, _ = await env.reset()
    assert observations[0].content == source.task_summary("train", 7)["question"]
    _, reward, done, _ = await env.step(action)
    assert reward == pytest.approx(expected)
    assert done
    assert reward_components(env) == {"digit_fraction": pytest.approx(expected)}
    with pytest.raises(RuntimeError, match="already ended"):
        await env.step(action)
    assert await source.rescore("train", 7, [observations[0], action]) == (
        pytest.approx(expected),
        {"digit_fraction": pytest.approx(expected)},
    )


def test_toy_tasks_are_fixed_and_varied() -> None:
    source = load_source("toy")
    assert source.splits == {"train": 512, "test": 64}
    prompts = [source.task_summary("train", i)["question"] for i in range(512)]
    assert prompts == [load_source("toy").task_summary("train", i)["question"] for i in range(512)]
    assert len(set(prompts)) > 300
    dataset = DigitsTaskDataset("train")  # the same tasks as an Aviary TaskDataset
    assert len(dataset) == 512
    assert dataset.get_new_env_by_idx(5).prompt == prompts[5]
    with pytest.raises(KeyError, match="no split 'dev'"):
        DigitsTaskDataset("dev")


# ---------------------------------------------------------------- catalog


def test_builtin_names() -> None:
    assert builtin_names() == ["gsm8k", "notebook", "toy"]


async def test_catalog_errors_name_what_to_fix() -> None:
    with pytest.raises(ValueError, match=r"unknown environment 'nope'.*gsm8k.*notebook.*toy"):
        load_source("nope")
    with pytest.raises(ValueError, match="data_dir"):
        load_source("toy", {"data_dir": "/tmp"})
    source = load_source("toy")
    with pytest.raises(KeyError, match="no split 'validation'"):
        await source.make("validation", 0)
    with pytest.raises(IndexError, match=r"indices 0\.\.63"):
        await source.make("test", 64)
    with pytest.raises(IndexError, match="out of range"):
        source.task_summary("test", -1)
    with pytest.raises(ValueError, match="missing"):
        await source.make_inline({"prompt": "Reply with a number"})


async def test_catalog_falls_back_to_aviary_registry() -> None:
    dummy = load_source("dummy")  # Aviary's infinite DummyTaskDataset
    assert dummy.splits == {"default": UNBOUNDED}
    env = await dummy.make("default", 1000)
    observations, _ = await env.reset()
    assert "print_story" in observations[0].content
    with pytest.raises(RescoreUnsupportedError):
        await dummy.rescore("default", 0, [])

    calculator = load_source("calculator")  # an Aviary environment without a dataset
    assert calculator.splits == {}
    env = await calculator.make_inline({"question": "What is 2 + 2?"})
    observations, _ = await env.reset()
    assert observations[0].content == "What is 2 + 2?"
