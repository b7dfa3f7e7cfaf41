"""What every environment source offers the server: tasks by split and index, inline tasks,
summaries for logs, and (where the environment allows it) re-scoring of stored trajectories."""

import hashlib
import importlib.metadata
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from aviary.core import Environment, Message, Tool, ToolCall, ToolRequestMessage
from aviary.tools.base import FunctionInfo

# Size reported for a split whose dataset has no length (Aviary's infinite TaskDatasets).
UNBOUNDED = -1

RewardComponents = dict[str, float]

# Task ids a source remembers (see EnvironmentSource.task_id).
TASK_IDS_KEPT = 100_000

# Part of every built-in environment's version: Aviary runs their dynamics and graders.
AVIARY_VERSION = importlib.metadata.version("fhaviary")


def content_id(env: str, fields: Mapping[str, str]) -> str:
    """A task id that depends on the task's content only: `env:` + 16 hex digits of the SHA-256
    of its fields as canonical JSON."""
    canonical = json.dumps(dict(fields), sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return f"{env}:{hashlib.sha256(canonical.encode()).hexdigest()[:16]}"


class RescoreUnsupportedError(NotImplementedError):
    """The source cannot score a stored trajectory without replaying it."""


class ReferenceUnsupportedError(NotImplementedError):
    """The source has no reference answers to give."""


def submission(answer: str) -> ToolRequestMessage:
    """An assistant action calling submit_answer with `answer`."""
    return ToolRequestMessage(tool_calls=[ToolCall.from_name("submit_answer", answer=answer)])


class ForkUnsupportedError(NotImplementedError):
    """The source cannot copy a live episode."""


# How a source forks an episode (EnvironmentInfo.fork): a direct copy of its state, a replay of
# its actions on a copy of its workspace, or not at all.
FORK_COPY, FORK_REPLAY, FORK_UNSUPPORTED = "copy", "replay", "unsupported"


@runtime_checkable
class ReportsRewardComponents(Protocol):
    """An environment that explains its last reward as named components."""

    reward_components: RewardComponents


def reward_components(env: Environment) -> RewardComponents:
    """The named parts of the env's latest reward; empty for envs that do not report them."""
    # What isinstance(env, ReportsRewardComponents) checks, without typing's slow protocol check.
    components = getattr(env, "reward_components", None)
    return dict(components) if components is not None else {}


def no_submission(reward: float) -> tuple[float, RewardComponents]:
    """The reward of an episode that submitted no answer, graded as a wrong answer worth `reward`."""
    return reward, {"correct": 0.0, "submitted": 0.0}


def last_tool_argument(messages: Sequence[Message], tool: str, argument: str) -> str | None:
    """The `argument` of the latest call to `tool` in a trajectory, or None if never called.

    Arguments are returned as strings because answers are compared as text or parsed numbers.
    """
    for message in reversed(messages):
        if not isinstance(message, ToolRequestMessage):
            continue
        for call in reversed(message.tool_calls):
            if call.function.name == tool and argument in call.function.arguments:
                return str(call.function.arguments[argument])
    return None


# (environment class, the method's function) -> the tool's name, description and JSON Schema.
# A method's schema depends only on its signature and docstring, which never change at run time,
# so it is built once per class instead of once per episode (pydantic builds a model for it).
_TOOL_INFOS: dict[tuple[type, Callable[..., Any]], FunctionInfo] = {}


def cached_tool(method: Callable[..., Any], run: Callable[..., Any] | None = None) -> Tool:
    """The tool `Tool.from_function(method)` makes, for a bound method of an environment (or a
    function), with its schema built once per environment class and method and shared after that.

    run: what the tool calls instead of `method`, with the same arguments (a coroutine that
    runs `method` on the event loop, say); by default `method` itself."""
    # A bound method: its class and function; a plain function: itself.
    key = (type(getattr(method, "__self__", None)), getattr(method, "__func__", method))
    info = _TOOL_INFOS.get(key)
    if info is None:
        info = _TOOL_INFOS[key] = Tool.from_function(method).info
    return Tool(tool_fn=run or method, info=info)


def require_fields(
    source: str, task: Mapping[str, str], required: set[str], optional: frozenset[str] = frozenset()
) -> None:
    """Reject an inline task whose fields are missing or unknown, naming what is expected."""
    missing = required - task.keys()
    unknown = task.keys() - required - optional
    if missing or unknown:
        raise ValueError(
            f"{source} inline tasks take fields {sorted(required)} (optional: {sorted(optional)});"
            f" missing {sorted(missing)}, unknown {sorted(unknown)}"
        )


class EnvironmentSource(ABC):
    """A named family of Aviary environments the server can open episodes on.

    `make` and `make_inline` return a fresh environment that has not been reset; the caller
    owns it and must `close()` it.
    """

    name: str
    description: str
    # Bump environment_version when the same actions could lead to other observations, and
    # grader_version when the same trajectory could get another reward (Reward.provenance).
    environment_version: str = "1"
    grader_version: str = "1"
    # How `fork` copies a live environment: FORK_COPY, FORK_REPLAY or FORK_UNSUPPORTED.
    fork_mode: str = FORK_UNSUPPORTED
    # (min, max, baseline) of an episode's reward with the default episode options: the lowest
    # and highest reward, and what an episode without a correct answer earns
    # (EnvironmentInfo.reward_range); None: not declared.
    reward_range: tuple[float, float, float] | None = None

    @property
    @abstractmethod
    def splits(self) -> dict[str, int]:
        """Split name -> number of tasks (UNBOUNDED when the dataset has no length)."""

    @abstractmethod
    async def _make_checked(self, split: str, index: int) -> Environment:
        """Build the environment for a split and index already known to be valid."""

    @abstractmethod
    async def make_inline(self, task: dict[str, str]) -> Environment:
        """Build an environment for a task given as fields; bad fields raise ValueError."""

    @abstractmethod
    def _summary_checked(self, split: str, index: int) -> dict[str, str]:
        """Short description of a valid task for logs and viewers. It is sent to the agent with
        every Reset, so it must not contain the answer or anything else that grades the task."""

    def task_id(self, split: str, index: int) -> str:
        """A stable id of a valid task: a digest of what defines it (`_task_content`), so it does
        not change when the dataset is reordered. Worked out once per task (its content never
        changes), not on every Reset: the digest of the canonical JSON cost more than the rest
        of a GSM8K reset."""
        ids: dict[tuple[str, int], str] = self.__dict__.setdefault("_task_ids", {})
        known = ids.get((split, index))
        if known is None:
            if len(ids) >= TASK_IDS_KEPT:  # unbounded splits have no last index
                ids.clear()
            known = ids[(split, index)] = content_id(self.name, self._task_content(split, index))
        return known

    def _task_content(self, split: str, index: int) -> Mapping[str, str]:
        """What defines a task; the summary by default (override to include the answer)."""
        return self._summary_checked(split, index)

    def inline_task_id(self, fields: Mapping[str, str]) -> str:
        return content_id(self.name, fields)

    @property
    def versions(self) -> tuple[str, str]:
        """(environment version, grader version), each with the Aviary release it runs on."""
        return (f"{self.name}/{self.environment_version}+aviary-{AVIARY_VERSION}",
                f"{self.name}/{self.grader_version}+aviary-{AVIARY_VERSION}")

    async def make(self, split: str, index: int) -> Environment:
        self.check_task(split, index)
        return await self._make_checked(split, index)

    def task_summary(self, split: str, index: int) -> dict[str, str]:
        self.check_task(split, index)
        return self._summary_checked(split, index)

    def reference_actions(self, split: str, index: int) -> list[Message]:
        """The actions of an agent that knows the answer of this task (already checked), with the
        default episode options, in order: a reference episode earns the top of `reward_range`."""
        raise ReferenceUnsupportedError(f"environment {self.name!r} has no reference answers")

    async def rescore(
        self, split: str, index: int, messages: Sequence[Message]
    ) -> tuple[float, RewardComponents]:
        """Score a stored trajectory of this task without replaying it."""
        raise RescoreUnsupportedError(
            f"environment {self.name!r} cannot score a stored trajectory; replay it instead"
        )

    async def rescore_inline(
        self, task: dict[str, str], messages: Sequence[Message]
    ) -> tuple[float, RewardComponents]:
        """Score a stored trajectory of an inline task (the fields it was reset with) without
        replaying it; bad fields raise ValueError, as make_inline does."""
        raise RescoreUnsupportedError(
            f"environment {self.name!r} cannot score a stored trajectory of an inline task; replay it instead"
        )

    def check_episode_options(self, options: Mapping[str, str]) -> None:
        """ValueError, saying what is accepted, unless this source takes `options` (a Reset's
        per-episode options). The default: no per-episode options at all."""
        if options:
            raise ValueError(f"environment {self.name!r} takes no per-episode options (got {sorted(options)});"
                             " environment options are set in the server's configuration (env_options)")

    def configure(self, env: Environment, options: Mapping[str, str]) -> None:
        """Apply checked per-episode `options` to a fresh `env` before its reset; the default
        takes none."""

    async def fork(self, env: Environment) -> Environment:
        """A new environment in the state `env` is in now (reset already), independent of it from
        then on; the caller owns it and must `close()` it. `env` is not changed. The default:
        ForkUnsupportedError."""
        raise ForkUnsupportedError(f"environment {self.name!r} cannot fork a live episode")

    def unanswered_reward(self, env: Environment) -> tuple[float, RewardComponents] | None:
        """The reward added to an episode's return when it has not ended with an answer (the
        agent ran out of budget, or Verify came early), for environments whose tasks are
        answered once: a missing answer is a wrong one. None, the default: such an episode
        cannot be judged and is reported UNSCORED."""
        return None

    def start(self, room: Callable[[], int] | None = None) -> None:
        """Start the source's background work (the notebook's kernel pool), on the running event
        loop, when the server starts. `room`: how many more episodes the server may open now, which
        resources held ahead count against. The default: nothing to start."""

    async def aclose(self) -> None:
        """Stop the background work and free what it holds, when the server stops."""

    def pool_stats(self) -> Any:
        """The state of the source's pool of resources started ahead (a kernel_pool.PoolStats), or
        None where it keeps none (the default)."""
        return None

    def check_task(self, split: str, index: int) -> None:
        """KeyError for an unknown split, IndexError for an index outside it."""
        splits = self.splits
        if split not in splits:
            raise KeyError(
                f"environment {self.name!r} has no split {split!r}; its splits are {sorted(splits)}"
            )
        size = splits[split]
        if index < 0 or (size != UNBOUNDED and index >= size):
            bound = "any index >= 0" if size == UNBOUNDED else f"indices 0..{size - 1}"
            raise IndexError(
                f"task index {index} is out of range for {self.name!r} split {split!r},"
                f" which has {bound}"
            )
