"""Generate the one-step word problems of the gsm8k environment's short splits.

Run `python env_servers/data/gsm8k/generate_short.py` to rewrite `short_train.jsonl`,
`short_test.jsonl` and their text-answer twins `short_text_train.jsonl` / `short_text_test.jsonl`;
the output is a pure function of SEED (byte-identical on rerun).

Why these exist: a 135M-parameter model solves none of the two- and three-step problems of the
`train`/`test` splits and, left alone, does not even call a tool, so RL on them has no signal.
Each problem here is one operation (+, -, x or /) on numbers up to 20 (a product up to 400), in
the same GSM8K row format, graded by the same CalculatorEnv: the answer still has to go through
`submit_answer`, and the calculator is there to use. Each question ends with one sentence saying how
to answer (`ANSWER_FORMAT`). What a model learns on them: to end its turn with a well-formed
`submit_answer` tool call holding the number, and to get one arithmetic step right. Train and test
problems are drawn from the same templates with different numbers and names: the test split
measures that skill on problems never trained on, not transfer to harder problems.

The text twins hold the same problems with `TEXT_FORMAT` in place of `ANSWER_FORMAT`: the answer
is the reply itself, no tool is offered, and the last number of the reply is graded (GSM8K's usual
final-number extraction). They exist because a 135M model's tool calls are almost never right
(bench/real_model.py), while it answers about a quarter of these problems in plain text: GRPO gets
mixed groups to learn from. What a model learns on them: one arithmetic step, stated as the number.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

SEED = 20261201
TRAIN_SIZE = 400
TEST_SIZE = 100

ANSWER_FORMAT = ('Reply with <tool_call>{"name": "submit_answer", "arguments": {"answer": "NUMBER"}}</tool_call>,'
                 " writing the answer in place of NUMBER.")
TEXT_FORMAT = "Reply with the number only."

NAMES = ["Ava", "Ben", "Chloe", "Diego", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonah",
         "Keiko", "Liam", "Maya", "Noor", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tara"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "shells", "cards",
         "stamps", "beads"]

Problem = tuple[str, str, int]  # question, GSM8K-annotated reasoning, answer


def _calc(expr: str, value: int) -> str:
    return f"{expr} = <<{expr}={value}>>{value}"


def add(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    have, more = rng.randint(2, 20), rng.randint(2, 20)
    question = f"{name} has {have} {item} and gets {more} more. How many {item} does {name} have now?"
    return question, f"{name} has {_calc(f'{have}+{more}', have + more)} {item}.", have + more


def subtract(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    have = rng.randint(5, 20)
    gives = rng.randint(1, have - 1)
    question = f"{name} has {have} {item} and gives away {gives}. How many {item} does {name} have left?"
    return question, f"{name} has {_calc(f'{have}-{gives}', have - gives)} {item} left.", have - gives


def multiply(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    bags, each = rng.randint(2, 20), rng.randint(2, 20)
    question = f"{name} buys {bags} bags with {each} {item} in each bag. How many {item} does {name} buy?"
    return question, f"{name} buys {_calc(f'{bags}*{each}', bags * each)} {item}.", bags * each


def divide(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    friends, each = rng.randint(2, 10), rng.randint(2, 20)
    total = friends * each
    question = (f"{name} shares {total} {item} equally among {friends} friends."
                f" How many {item} does each friend get?")
    return question, f"Each friend gets {_calc(f'{total}/{friends}', each)} {item}.", each


TEMPLATES: list[Callable[[random.Random], Problem]] = [add, subtract, multiply, divide]


def generate_problems(count: int, rng: random.Random) -> list[Problem]:
    """Cycle through the templates so each split holds every operation equally often."""
    return [TEMPLATES[index % len(TEMPLATES)](rng) for index in range(count)]


def rows_of(problems: list[Problem], answer_format: str) -> list[dict[str, str]]:
    return [{"question": f"{question} {answer_format}", "answer": f"{reasoning}\n#### {answer}"}
            for question, reasoning, answer in problems]


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def main() -> None:
    rng = random.Random(SEED)
    here = Path(__file__).parent
    for split, size in (("train", TRAIN_SIZE), ("test", TEST_SIZE)):
        problems = generate_problems(size, rng)
        write_jsonl(here / f"short_{split}.jsonl", rows_of(problems, ANSWER_FORMAT))
        write_jsonl(here / f"short_text_{split}.jsonl", rows_of(problems, TEXT_FORMAT))


if __name__ == "__main__":
    main()
