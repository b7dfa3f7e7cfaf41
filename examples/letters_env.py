"""An environment of your own in Python: count the letters of a word (the tutorial of the docs,
docs/tutorial.md). Host it with `--set env.imports=[examples/letters_env.py] --set env.envs=[letters]`.

Reward: 1 for the right count, less the further off the first number of the reply is (0 from 5
away), 0 for a reply without a number."""

import random
import re
from collections.abc import Sequence

from aviary.core import Environment, Message, Messages, Tool, ToolRequestMessage

from env_servers.catalog import register
from env_servers.envs.source import EnvironmentSource, require_fields

WORDS = ["cat", "apple", "banana", "orbit", "planet", "quantum", "river", "enzyme", "crystal",
         "photon", "galaxy", "neutron", "molecule", "catalyst", "spectrum", "gradient"]
SPLITS = {"train": 200, "test": 40}


def word_of(split: str, index: int) -> str:
    """Task `index` of `split`: a fixed function of both, so a task never changes."""
    return random.Random(f"letters/{split}/{index}").choice(WORDS)


def score(word: str, reply: str) -> float:
    number = re.search(r"\d+", reply)
    if number is None:
        return 0.0
    return max(0.0, 1.0 - abs(int(number.group()) - len(word)) / 5)


class LettersEnv(Environment[None]):
    """One step: the reply is scored and the episode ends."""

    def __init__(self, word: str) -> None:
        self.word = word

    async def reset(self) -> tuple[Messages, list[Tool]]:
        self.tools = []  # no tools: the reply itself is the answer
        return [Message(content=f"How many letters are in the word '{self.word}'? Reply with a number.")], []

    async def step(self, action: Message) -> tuple[Messages, float, bool, bool]:
        reward = score(self.word, action.content or "")
        observations = [Message(content=f"Scored {reward:.2f}.")]
        if isinstance(action, ToolRequestMessage) and action.tool_calls:  # answer every call, as the protocol asks
            observations = await self.exec_tool_calls(action, handle_tool_exc=True)
        return observations, reward, True, False


class LettersSource(EnvironmentSource):
    """What the env server hosts: the splits, how to build task i, and the reference answer."""

    name = "letters"
    description = "Count the letters of a word. Reward 1 for the right number, less the further off."
    reward_range = (0.0, 1.0, 0.0)  # (min, max, what a reply without the right answer earns at least)

    def __init__(self, options: dict) -> None:
        if options:
            raise ValueError(f"letters takes no options, got {sorted(options)}")

    @property
    def splits(self) -> dict[str, int]:
        return dict(SPLITS)

    async def _make_checked(self, split: str, index: int) -> LettersEnv:
        return LettersEnv(word_of(split, index))

    async def make_inline(self, task: dict[str, str]) -> LettersEnv:
        require_fields(self.name, task, {"word"})
        return LettersEnv(task["word"])

    def _summary_checked(self, split: str, index: int) -> dict[str, str]:
        return {"word": word_of(split, index)}

    def reference_actions(self, split: str, index: int) -> list[Message]:
        return [Message(role="assistant", content=str(len(word_of(split, index))))]

    async def rescore(self, split: str, index: int, messages: Sequence[Message]) -> tuple[float, dict]:
        """Grade a stored trajectory (Verify of a trajectory) as `step` graded it live."""
        self.check_task(split, index)
        return score(word_of(split, index), last_reply(messages)), {}

    async def rescore_inline(self, task: dict[str, str], messages: Sequence[Message]) -> tuple[float, dict]:
        require_fields(self.name, task, {"word"})
        return score(task["word"], last_reply(messages)), {}


def last_reply(messages: Sequence[Message]) -> str:
    replies = [message.content or "" for message in messages if message.role == "assistant"]
    return replies[-1] if replies else ""


register("letters", LettersSource)
