"""GSM8K-format arithmetic word problems on Aviary's own CalculatorEnv, in GSM8kDataset's format.

The data ships in env_servers/data/gsm8k (train.jsonl, test.jsonl, and the short splits); the
tasks are made from those rows as Aviary's GSM8kDataset makes them (which can read the same folder
through `hf_source=<that folder>`), so nothing is downloaded.
"""

import ast
import asyncio
import copy
import inspect
import json
import operator
import re
from collections.abc import Callable, Sequence
from functools import cached_property
from pathlib import Path
from typing import ClassVar

from aviary.core import Environment, Message, Messages, Tool, ToolCall, ToolRequestMessage
from aviary.envs.gsm8k import CalculatorEnv, CalculatorEnvConfig
from aviary.envs.gsm8k.env import SafeMathEvaluator
from pydantic import BaseModel, ConfigDict, Field

from env_servers.envs.source import (
    FORK_COPY,
    EnvironmentSource,
    ForkUnsupportedError,
    RewardComponents,
    cached_tool,
    last_tool_argument,
    no_submission,
    require_fields,
    submission,
)

DATA_DIR = Path(__file__).resolve().parent.parent / "data" / "gsm8k"

# Our split name -> (file in DATA_DIR, Aviary's GSM8kDatasetSplit). Aviary's "train" keeps 80% of
# the training file; "train_full" keeps all of it, which is what a small shipped set wants. The
# short splits (one-step problems, data/gsm8k/generate_short.py) are not files Aviary's dataset
# reads (it knows only train and test): their CalculatorEnvs are built from the rows directly.
# The short_text splits are answered in plain text (TextAnswerEnv), the others by submit_answer.
SPLITS: dict[str, tuple[str, str | None]] = {
    "train": ("train.jsonl", "train_full"),
    "test": ("test.jsonl", "test"),
    "short_train": ("short_train.jsonl", None),
    "short_test": ("short_test.jsonl", None),
    "short_text_train": ("short_text_train.jsonl", None),
    "short_text_test": ("short_text_test.jsonl", None),
}
TEXT_ANSWER_SPLITS = frozenset(split for split in SPLITS if split.startswith("short_text_"))


class GSM8kOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    data_dir: Path = Field(default=DATA_DIR, description="Folder of the split files (<split>.jsonl)")


def parse_answer_number(answer: str) -> float:
    """The number of a GSM8K answer: either bare ("72") or after GSM8K's "#### " marker."""
    text = answer.split("#### ")[-1].replace(",", "").strip()
    try:
        return float(text)
    except ValueError:
        raise ValueError(
            f"gsm8k answer must be a number or end in '#### <number>', got {answer!r}"
        ) from None


# Aviary's calculator computes any expression it is given: 9**9**9 is an integer of 1.2 GB whose
# computation holds the interpreter for minutes, freezing every episode on the server (a step
# timeout cannot interrupt it). Expressions and every intermediate result are bounded instead.
MAX_EXPRESSION_CHARS = 2000
MAX_RESULT_BITS = 10_000  # about 3000 decimal digits, under Python's 4300-digit str() limit


def _checked(result: float) -> float:
    if isinstance(result, int) and result.bit_length() > MAX_RESULT_BITS:
        raise ValueError(f"a result has more than {MAX_RESULT_BITS} bits; the calculator stops there")
    return result


def _bounded_pow(base: float, exponent: float) -> float:
    """base ** exponent, refused before computing when the result would exceed MAX_RESULT_BITS:
    bits(|base| ** exponent) = exponent * log2(|base|)."""
    whole = isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1 and exponent > 0
    if whole and exponent * (abs(base).bit_length() - 1) > MAX_RESULT_BITS:  # a lower bound of the bits
        raise ValueError(f"{base} ** {exponent} has more than {MAX_RESULT_BITS} bits; the calculator"
                             " stops there")
    return _checked(operator.pow(base, exponent))


def _bounded_round(number: float, ndigits: int | None = None) -> float:
    """round(), refused for ndigits so far from 0 that round(5, -10**9) would compute 10**10**9."""
    if isinstance(ndigits, int) and abs(ndigits) > MAX_RESULT_BITS:
        raise ValueError(f"round() to {ndigits} digits; the calculator takes at most {MAX_RESULT_BITS}")
    return round(number, ndigits)


def _bounded(function: Callable[..., float]) -> Callable[..., float]:
    return lambda *args: _checked(function(*args))


class BoundedMathEvaluator(SafeMathEvaluator):
    """Aviary's evaluator with every operation's result bounded (see MAX_RESULT_BITS)."""

    SAFE_OPERATORS: ClassVar[dict[type, Callable[..., float]]] = {
        **{op: _bounded(function) for op, function in SafeMathEvaluator.SAFE_OPERATORS.items()},
        ast.Pow: _bounded_pow,
    }
    SAFE_FUNCTIONS: ClassVar[dict[str, Callable[..., float]]] = {
        **{name: _bounded(function) for name, function in SafeMathEvaluator.SAFE_FUNCTIONS.items()},
        "round": _bounded(_bounded_round),
    }


# A tool call whose argument is at most this long runs on the event loop, not a worker thread:
# the calculator's worst case at this length (a chain of MAX_RESULT_BITS powers) is ~5 ms, while
# a typical GSM8K call ("12 * 34 + 5") takes microseconds, far less than the thread hand-off.
# Longer ones (up to MAX_EXPRESSION_CHARS, ~30 ms at worst) keep Aviary's worker thread, so no
# single call holds up every other episode on the server for long.
INLINE_ARGUMENT_CHARS = 256


def _on_the_loop_when_short(method: Callable[..., object], argument: str) -> Callable[..., object]:
    async def run(**arguments: object) -> object:
        if len(str(arguments.get(argument, ""))) <= INLINE_ARGUMENT_CHARS:
            return method(**arguments)
        return await asyncio.to_thread(method, **arguments)

    # exec_tool_calls reads the tool function's signature on every call; give it the answer.
    run.__signature__ = _KEYWORDS_ONLY  # type: ignore[attr-defined]
    return run


_KEYWORDS_ONLY = inspect.signature(lambda **arguments: None)


class BoundedCalculatorEnv(CalculatorEnv):
    """CalculatorEnv whose calculator refuses expressions too long or too large to compute.

    Its reset is CalculatorEnv's (the environment is stateless: the problem is fixed), with the
    tools' schemas built once for the class instead of once per episode (`cached_tool`), and
    short tool calls run on the event loop (see INLINE_ARGUMENT_CHARS).
    """

    async def reset(self) -> tuple[Messages, list[Tool]]:
        self.state = None
        self.tools = self._tools()
        return [Message(content=self.problem)], self.tools

    def _tools(self) -> list[Tool]:
        return [
            cached_tool(self.calculator, run=_on_the_loop_when_short(self.calculator, "expr")),
            cached_tool(self.submit_answer, run=_on_the_loop_when_short(self.submit_answer, "answer")),
        ]

    def fork(self) -> "BoundedCalculatorEnv":
        """A copy of this reset environment, with tools bound to the copy (a deep copy would keep
        the tools' closures calling this one)."""
        twin = copy.deepcopy(self)
        twin.tools = twin._tools()
        return twin

    def calculator(self, expr: str) -> tuple[float | str, float, bool]:
        try:
            if len(expr) > MAX_EXPRESSION_CHARS:
                raise ValueError(f"the expression has {len(expr)} characters; at most"
                                 f" {MAX_EXPRESSION_CHARS} are evaluated")
            BoundedMathEvaluator.evaluate(expr.strip())
        except Exception as exc:  # noqa: BLE001 -- answered as Aviary answers a failing expression
            return f"Error using calculator: {exc!r}.", self.config.tool_failure_reward, self.config.done_on_failure
        return super().calculator(expr)  # bounded now: the same operations on the same values

    calculator.__doc__ = CalculatorEnv.calculator.__doc__  # the tool's description and arguments


# GSM8K's calculator annotations in a worked solution: "<<48/4=12>>" (expression = result).
_ANNOTATION = re.compile(r"<<([^<>=]+)=([^<>]*)>>")


def annotated_expressions(solution: str) -> list[str]:
    """The expressions of a GSM8K solution's `<<expression=result>>` annotations, in order."""
    return [match.group(1).strip() for match in _ANNOTATION.finditer(solution)]


def calculation(expression: str) -> ToolRequestMessage:
    """An assistant action calling the calculator on `expression`."""
    return ToolRequestMessage(tool_calls=[ToolCall.from_name("calculator", expr=expression)])


# A number as a reply writes it: "-12", "1,250", "7.5" (the comma groups thousands).
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(text: str) -> str | None:
    """The last number written in `text` without its thousands commas, or None: GSM8K's usual
    final-number extraction from a reply in prose."""
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


class TextAnswerEnv(CalculatorEnv):
    """A GSM8K problem answered in plain text: no tools, and the first reply ends the episode,
    graded by its last number as CalculatorEnv.submit_answer grades a submission (1 correct,
    0 otherwise; a reply with no number is a wrong answer, not a failed tool call)."""

    async def reset(self) -> tuple[Messages, list[Tool]]:
        self.state = None
        self.tools = []
        return [Message(content=self.problem)], self.tools

    def fork(self) -> "TextAnswerEnv":
        return copy.deepcopy(self)

    async def step(self, action: Message) -> tuple[Messages, float, bool, bool]:
        correct, reward = grade_text_reply(self, action)
        self.state = {"correct": correct}
        verdict = "correct" if correct else "incorrect"
        return [Message(content=f"The answer is {verdict}.")], reward, True, False


def grade_text_reply(env: CalculatorEnv, reply: Message) -> tuple[bool, float]:
    """(correct, reward) of `reply` to `env`'s problem: its last number, as env.submit_answer
    grades a submission; no number is a wrong answer."""
    submitted = last_number(reply.content or "")  # a tool call (none is offered): its text alone
    if submitted is None:
        return False, env.config.incorrect_reward
    correct, reward, _ = env.submit_answer(submitted)
    return correct, reward


class GSM8kSource(EnvironmentSource):
    name = "gsm8k"
    description = (
        "Arithmetic word problems in GSM8K format; tools: calculator(expr), submit_answer(answer)."
        " Reward 1 for a correct submission, 0 for a wrong one, -1 for a failed tool call."
    )

    fork_mode = FORK_COPY  # the environment holds no state but its problem: a copy is exact
    # A failed calculator call costs tool_failure_reward (-1); a wrong or missing answer earns 0.
    reward_range = (-1.0, 1.0, 0.0)

    def __init__(self, options: GSM8kOptions) -> None:
        self.options = options
        self._problems_of: dict[str, list[tuple[str, str, float]]] = {}
        self._config = CalculatorEnvConfig()
        for split in ("train", "test"):
            if not (options.data_dir / SPLITS[split][0]).is_file():
                raise FileNotFoundError(
                    f"gsm8k data file {options.data_dir / SPLITS[split][0]} is missing; run"
                    " env_servers/data/gsm8k/generate.py or point data_dir at a GSM8K folder"
                )

    @cached_property
    def _rows(self) -> dict[str, list[dict[str, str]]]:
        """Rows of every split whose file is there (a GSM8K folder may lack the short splits)."""
        return {
            split: [
                json.loads(line)
                for line in (self.options.data_dir / file_name).read_text().splitlines()
            ]
            for split, (file_name, _) in SPLITS.items()
            if (self.options.data_dir / file_name).is_file()
        }

    @property
    def splits(self) -> dict[str, int]:
        return {split: len(rows) for split, rows in self._rows.items()}

    def _problems(self, split: str) -> list[tuple[str, str, float]]:
        """(problem_id, problem, answer) of every task of `split`, made once per split from its
        rows as Aviary's GSM8kDataset makes them (ids `<Aviary split>_<index>`, the number after
        "#### "). Not read through GSM8kDataset: its Hugging Face loader takes every file of the
        folder whose name holds the split's (test.jsonl and short_test.jsonl for "test"), and a
        row lookup in its DataFrame per episode cost more than the rest of a reset."""
        problems = self._problems_of.get(split)
        if problems is None:
            prefix = SPLITS[split][1] or split
            problems = self._problems_of[split] = [
                (f"{prefix}_{index}", row["question"], parse_answer_number(row["answer"]))
                for index, row in enumerate(self._rows[split])
            ]
        return problems

    async def _make_checked(self, split: str, index: int) -> CalculatorEnv:
        problem_id, problem, answer = self._problems(split)[index]
        kind = TextAnswerEnv if split in TEXT_ANSWER_SPLITS else BoundedCalculatorEnv
        return kind(problem_id, problem, answer, self._config)

    async def make_inline(self, task: dict[str, str]) -> CalculatorEnv:
        require_fields(self.name, task, {"question", "answer"})
        return BoundedCalculatorEnv(
            problem_id=None, problem=task["question"], answer=parse_answer_number(task["answer"])
        )

    def _task_content(self, split: str, index: int) -> dict[str, str]:
        row = self._rows[split][index]
        return {"question": row["question"], "answer": row["answer"]}

    def _summary_checked(self, split: str, index: int) -> dict[str, str]:
        # The summary reaches the agent (ResetResponse.task_summary): never the answer.
        return {"question": self._rows[split][index]["question"]}

    def reference_actions(self, split: str, index: int) -> list[Message]:
        """The dataset's worked solution as actions: one calculator call per `<<expression=result>>`
        annotation of its answer, in order, then the answer (after "#### ") submitted; in a text
        split the reply is the answer itself (no tool is offered there)."""
        solution = self._rows[split][index]["answer"]
        answer = solution.split("#### ")[-1].strip()
        if split in TEXT_ANSWER_SPLITS:
            return [Message(role="assistant", content=answer)]
        return [*(calculation(expression) for expression in annotated_expressions(solution)), submission(answer)]

    async def rescore(
        self, split: str, index: int, messages: Sequence[Message]
    ) -> tuple[float, RewardComponents]:
        """Score the final submit_answer call the way CalculatorEnv.submit_answer does.

        Only the submission is scored: rewards earned by calculator calls are not replayed.
        """
        self.check_task(split, index)
        row = self._rows[split][index]
        answer = parse_answer_number(row["answer"])
        if split in TEXT_ANSWER_SPLITS:
            return _score_text_reply(row["question"], answer, messages)
        return _score_submission(row["question"], answer, messages)

    async def rescore_inline(
        self, task: dict[str, str], messages: Sequence[Message]
    ) -> tuple[float, RewardComponents]:
        """As `rescore`, against the inline task's question and answer."""
        require_fields(self.name, task, {"question", "answer"})
        return _score_submission(task["question"], parse_answer_number(task["answer"]), messages)

    async def fork(self, env: Environment) -> Environment:
        if not isinstance(env, BoundedCalculatorEnv | TextAnswerEnv):
            raise ForkUnsupportedError(f"{type(env).__name__} is not a gsm8k environment of this server")
        return env.fork()

    def unanswered_reward(self, env: Environment) -> tuple[float, RewardComponents]:
        assert isinstance(env, CalculatorEnv), "gsm8k episodes run CalculatorEnv"
        return no_submission(env.config.incorrect_reward)


def _score_text_reply(question: str, answer: float, messages: Sequence[Message]) -> tuple[float, RewardComponents]:
    """The reward TextAnswerEnv gives the trajectory's first reply (the one that ended it)."""
    reply = next((m for m in messages if m.role == "assistant"), None)
    if reply is None:
        return no_submission(CalculatorEnvConfig().incorrect_reward)
    env = CalculatorEnv(problem_id=None, problem=question, answer=answer, config=CalculatorEnvConfig())
    correct, reward = grade_text_reply(env, reply)
    return reward, {"correct": float(correct), "submitted": 1.0}


def _score_submission(question: str, answer: float | str, messages: Sequence[Message]) -> tuple[float, RewardComponents]:
    """The reward CalculatorEnv.submit_answer gives the trajectory's last submission."""
    env = CalculatorEnv(problem_id=None, problem=question, answer=answer, config=CalculatorEnvConfig())
    submitted = last_tool_argument(messages, "submit_answer", "answer")
    if submitted is None:
        return no_submission(env.config.incorrect_reward)
    correct, reward, _ = env.submit_answer(submitted)
    return reward, {"correct": float(correct), "submitted": 1.0}
