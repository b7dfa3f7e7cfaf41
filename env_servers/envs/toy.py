"""A one-step toy task a tiny randomly initialised byte-level model can learn with GRPO on a CPU.

The prompt asks for digits; the reward is the fraction of the reply's characters that are ASCII
digits. A uniform byte-level policy emits a digit with probability 10/256, so it starts near
0.04 and the signal is dense enough for GRPO to push it above 0.8 in minutes.
"""

import copy
import random
import string
from collections.abc import Sequence

from aviary.core import Environment, Message, Messages, TaskDataset, Tool, ToolRequestMessage
from pydantic import BaseModel, ConfigDict

from env_servers.envs.source import (
    FORK_COPY,
    EnvironmentSource,
    ForkUnsupportedError,
    RewardComponents,
    require_fields,
)

SPLIT_SIZES = {"train": 512, "test": 64}
REFERENCE_REPLY = "0123456789"  # digits only: reward 1 on every task

NOUNS = ["apples", "birds", "cups", "doors", "eggs", "fish", "kites", "lamps", "maps", "pens"]
TEMPLATES = [
    "Reply with a number: {n} {noun}",
    "Reply with digits only: {n} {noun}",
    "Answer with a number. How many {noun}? {n}",
    "Count the {noun} and reply in digits: {n}",
    "Number only, please: {n} {noun}",
]


def task_prompt(split: str, index: int) -> str:
    """The prompt of task `index` in `split`; a fixed function of both, so tasks never change."""
    rng = random.Random(f"toy/{split}/{index}")  # str seeds hash deterministically (sha512)
    template = rng.choice(TEMPLATES)
    return template.format(n=rng.randint(1, 99), noun=rng.choice(NOUNS))


def digit_fraction(text: str) -> float:
    """reward = |{c in text : c in '0'..'9'}| / |text|, and 0 for an empty text."""
    if not text:
        return 0.0
    return sum(char in string.digits for char in text) / len(text)


def reply_text(action: Message) -> str:
    """What the agent replied: the first submit_answer argument if it called tools, else content.

    A tool request that never calls submit_answer replies with nothing.
    """
    if isinstance(action, ToolRequestMessage) and action.tool_calls:
        answers = [
            str(call.function.arguments.get("answer", ""))
            for call in action.tool_calls
            if call.function.name == "submit_answer"
        ]
        return answers[0] if answers else ""
    return action.content or ""


class DigitsState(BaseModel):
    done: bool = False


class DigitsEnv(Environment[DigitsState]):
    """Single step: any reply ends the episode with reward digit_fraction(reply)."""

    def __init__(self, prompt: str) -> None:
        self.prompt = prompt
        self.reward_components: RewardComponents = {}

    async def reset(self) -> tuple[Messages, list[Tool]]:
        self.state = DigitsState()
        self.reward_components = {}
        self.tools = [Tool.from_function(self.submit_answer)]
        return [Message(content=self.prompt)], self.tools

    async def step(self, action: Message) -> tuple[Messages, float, bool, bool]:
        if self.state.done:
            raise RuntimeError("this toy episode has already ended; reset() starts a new one")
        reward = digit_fraction(reply_text(action))
        self.state.done = True
        self.reward_components = {"digit_fraction": reward}
        if isinstance(action, ToolRequestMessage) and action.tool_calls:
            observations: Messages = await self.exec_tool_calls(action, handle_tool_exc=True)
        else:
            observations = [Message(content=f"Reply scored: digit fraction {reward:.3f}.")]
        return observations, reward, True, False

    def fork(self) -> "DigitsEnv":
        """A deep copy of this reset environment, its tool bound to the copy."""
        twin = copy.deepcopy(self)
        twin.tools = [Tool.from_function(twin.submit_answer)]
        return twin

    async def submit_answer(self, answer: str) -> str:
        """Submit your reply. This ends the episode.

        Args:
            answer: The reply, written with digits only.
        """
        return f"Reply scored: digit fraction {digit_fraction(answer):.3f}."


class DigitsTaskDataset(TaskDataset[DigitsEnv]):
    """One split of the toy tasks as an Aviary TaskDataset (so Aviary's own servers can host it)."""

    def __init__(self, split: str) -> None:
        if split not in SPLIT_SIZES:
            raise KeyError(f"toy has no split {split!r}; its splits are {sorted(SPLIT_SIZES)}")
        self.split = split

    def __len__(self) -> int:
        return SPLIT_SIZES[self.split]

    def get_new_env_by_idx(self, idx: int) -> DigitsEnv:
        return DigitsEnv(task_prompt(self.split, idx))


class ToyOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ToySource(EnvironmentSource):
    name = "toy"
    description = (
        "One-step toy task: reply with digits. Reward = fraction of the reply's characters that"
        " are ASCII digits (plain content, or the answer of a submit_answer call)."
    )

    fork_mode = FORK_COPY
    reward_range = (0.0, 1.0, 0.0)

    def __init__(self, options: ToyOptions) -> None:
        self.options = options

    @property
    def splits(self) -> dict[str, int]:
        return dict(SPLIT_SIZES)

    async def _make_checked(self, split: str, index: int) -> DigitsEnv:
        return DigitsTaskDataset(split).get_new_env_by_idx(index)

    async def make_inline(self, task: dict[str, str]) -> DigitsEnv:
        require_fields(self.name, task, {"question"})
        return DigitsEnv(task["question"])

    def _summary_checked(self, split: str, index: int) -> dict[str, str]:
        return {"question": task_prompt(split, index)}

    def reference_actions(self, split: str, index: int) -> list[Message]:
        return [Message(role="assistant", content=REFERENCE_REPLY)]

    async def fork(self, env: Environment) -> Environment:
        if not isinstance(env, DigitsEnv):
            raise ForkUnsupportedError(f"{type(env).__name__} is not a toy environment of this server")
        return env.fork()

    async def rescore(
        self, split: str, index: int, messages: Sequence[Message]
    ) -> tuple[float, RewardComponents]:
        """Score the trajectory's last assistant message, exactly as DigitsEnv.step does."""
        self.check_task(split, index)
        return _score_last_reply(messages)

    async def rescore_inline(
        self, task: dict[str, str], messages: Sequence[Message]
    ) -> tuple[float, RewardComponents]:
        """As `rescore`: the reward depends on the reply alone."""
        require_fields(self.name, task, {"question"})
        return _score_last_reply(messages)


def _score_last_reply(messages: Sequence[Message]) -> tuple[float, RewardComponents]:
    replies = [message for message in messages if message.role == "assistant"]
    reward = digit_fraction(reply_text(replies[-1])) if replies else 0.0
    return reward, {"digit_fraction": reward}
