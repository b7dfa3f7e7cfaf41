"""Semantic checks of an environment (`sciproto conformance env --semantic`): what its rewards
mean, not only how the protocol is spoken. On the first `tasks_per_split` tasks of every split:

    reward_range_declared    Describe declares the environment's reward range: min <= baseline <= max
    reference_reaches_max    the task's reference actions (Reference RPC) earn max, SCORED
    do_nothing_gets_baseline an empty reply earns at most baseline (the episode is graded as it stands)
    garbage_gets_baseline    a reply of junk text earns at most baseline
    same_seed_same_episode   the same task and seed give the same observations twice, for the
                             reset and for the reference actions that follow
    rewards_in_range         every reward seen (each Step's, each Verify's) lies in [min, max]
    verify_stored_agrees     Verify of each reference episode stored as a trajectory gives its live
                             grade (skipped when the server does not advertise verify.trajectory)

The reference answer comes from the server (the Reference RPC, added after protocol 1.2, role grader): only the
environment knows it. A do-nothing or garbage reply that earns more than baseline is a grader that
can be gamed (one verifier on a hub of 4,000 environments scored the empty string 1.0).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from sciproto.conformance.wire import Check, CheckFailed, Skipped, call_ok, check
from sciproto.pb import common_pb2, env_grpc, env_pb2

TASKS_PER_SPLIT = 2
SEED = 1234  # the seed both resets of same_seed_same_episode pass
JUNK = "}{ qwerty ~~ lorem ipsum \u00bf? <|/|> zzz"
TOLERANCE = 1e-6


def _id() -> str:
    return uuid.uuid4().hex


def _reply(text: str) -> common_pb2.ChatMessage:
    return common_pb2.ChatMessage(role=common_pb2.ROLE_ASSISTANT, content=text)


@dataclass
class Episode:
    """One played episode: its task, transcript, rewards and live grade."""

    task: str  # split/index
    messages: list[common_pb2.ChatMessage] = field(default_factory=list)
    step_rewards: list[float] = field(default_factory=list)
    grade: common_pb2.Reward = field(default_factory=common_pb2.Reward)
    task_ref: env_pb2.TaskRef = field(default_factory=env_pb2.TaskRef)


class SemanticChecks:
    """The semantic checks of one environment over a channel (see the module docstring)."""

    def __init__(self, channel: grpc.aio.Channel, env: str | None, timeout_s: float,
                 tasks_per_split: int = TASKS_PER_SPLIT) -> None:
        self.stub = env_grpc.EnvironmentServiceStub(channel)
        self.wanted_env = env
        self.timeout_s = timeout_s
        self.tasks_per_split = tasks_per_split
        self.info: env_pb2.EnvironmentInfo | None = None
        self.capabilities: list[str] = []
        self._references: list[Episode] | None = None
        self._seen: list[tuple[str, float]] = []  # (where, reward) of every reward seen

    # ---------------------------------------------------------------- helpers

    async def _describe(self) -> env_pb2.EnvironmentInfo:
        if self.info is None:
            described: env_pb2.EnvironmentServiceDescribeResponse = await call_ok(  # type: ignore[assignment]
                self.stub.Describe(env_pb2.EnvironmentServiceDescribeRequest(request_id=_id()),
                                   timeout=self.timeout_s), "Describe")
            self.capabilities = list(described.server.capabilities)
            hosted = {info.name: info for info in described.environments}
            check(hosted, "Describe lists no environment")
            name = self.wanted_env or next(iter(hosted))
            check(name in hosted, f"the server hosts no environment {name!r} (it hosts {sorted(hosted)})")
            self.info = hosted[name]
        return self.info

    async def _range(self) -> env_pb2.RewardRange:
        info = await self._describe()
        if not info.HasField("reward_range"):
            raise CheckFailed(f"Describe declares no reward_range for {info.name!r}: nothing to check rewards "
                              "against (added after protocol 1.2)")
        return info.reward_range

    async def _tasks(self) -> list[env_pb2.TaskRef]:
        info = await self._describe()
        return [env_pb2.TaskRef(split=split.name, index=index) for split in info.splits
                for index in range(split.size if not split.unbounded else self.tasks_per_split)
                if index < self.tasks_per_split]

    async def _play(self, task: env_pb2.TaskRef, actions: Sequence[common_pb2.ChatMessage],
                    seed: int = 0) -> Episode:
        """Reset `task`, Step `actions` until one ends the episode, Verify it live, Close it."""
        info = await self._describe()
        where = f"{task.split}/{task.index}"
        reset: env_pb2.ResetResponse = await call_ok(self.stub.Reset(  # type: ignore[assignment]
            env_pb2.ResetRequest(request_id=_id(), env=info.name, task_ref=task, seed=seed),
            timeout=self.timeout_s), f"Reset of {where}")
        episode = Episode(task=where, messages=list(reset.observations), task_ref=task)
        try:
            for action in actions:
                step: env_pb2.StepResponse = await call_ok(self.stub.Step(  # type: ignore[assignment]
                    env_pb2.StepRequest(request_id=_id(), episode_id=reset.episode_id, action=action),
                    timeout=self.timeout_s), f"Step of {where}")
                episode.messages += [action, *step.observations]
                episode.step_rewards.append(step.reward.value)
                self._seen.append((f"a Step of {where}", step.reward.value))
                if step.terminated or step.truncated:
                    break
            verified: env_pb2.VerifyResponse = await call_ok(self.stub.Verify(  # type: ignore[assignment]
                env_pb2.VerifyRequest(request_id=_id(), episode_id=reset.episode_id), timeout=self.timeout_s),
                f"Verify of {where}")
            episode.grade = verified.reward
            self._seen.append((f"the Verify of {where}", verified.reward.value))
        finally:
            await self.stub.Close(env_pb2.CloseRequest(request_id=_id(), episode_id=reset.episode_id),
                                  timeout=self.timeout_s)
        return episode

    async def _reference(self, task: env_pb2.TaskRef) -> list[common_pb2.ChatMessage]:
        info = await self._describe()
        try:
            response = await self.stub.Reference(env_pb2.ReferenceRequest(request_id=_id(), env=info.name,
                                                                          task_ref=task), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise Skipped(f"{info.name!r} gives no reference answers (Reference: UNIMPLEMENTED)") from None
            raise CheckFailed(f"Reference of {task.split}/{task.index} failed: {error.code().name}: "
                              f"{error.details()}") from None
        check(response.actions, f"Reference of {task.split}/{task.index} has no actions")
        return list(response.actions)

    async def _reference_episodes(self) -> list[Episode]:
        if self._references is None:
            episodes = []
            for task in await self._tasks():
                actions = await self._reference(task)
                episodes.append(await self._play(task, actions))
            self._references = episodes
        return self._references

    # ---------------------------------------------------------------- checks

    async def reward_range_declared(self) -> str:
        bounds = await self._range()
        check(bounds.min <= bounds.baseline <= bounds.max and bounds.min < bounds.max,
              f"reward_range must have min <= baseline <= max and min < max, got {_text(bounds)}")
        return f"{(await self._describe()).name}: {_text(bounds)}"

    async def reference_reaches_max(self) -> str:
        bounds = await self._range()
        episodes = await self._reference_episodes()
        for episode in episodes:
            grade = episode.grade
            check(grade.status == common_pb2.REWARD_STATUS_SCORED and _close(grade.value, bounds.max),
                  f"the reference episode of {episode.task} got {_grade(grade)}, not SCORED {bounds.max:g} "
                  f"(the top of its reward range)")
        return f"{len(episodes)} reference episodes over {_splits(episodes)}: each SCORED {bounds.max:g}"

    async def do_nothing_gets_baseline(self) -> str:
        return await self._floor("an empty reply", [_reply("")])

    async def garbage_gets_baseline(self) -> str:
        return await self._floor("a reply of junk text", [_reply(JUNK)])

    async def _floor(self, what: str, actions: Sequence[common_pb2.ChatMessage]) -> str:
        bounds = await self._range()
        tasks = await self._tasks()
        for task in tasks:
            episode = await self._play(task, actions)
            check(episode.grade.status != common_pb2.REWARD_STATUS_INFRA_ERROR,
                  f"{what} on {episode.task} got INFRA_ERROR: {episode.grade.detail}")
            check(episode.grade.value <= bounds.baseline + TOLERANCE,
                  f"{what} on {episode.task} earned {_grade(episode.grade)}, above the baseline "
                  f"{bounds.baseline:g}: the grader rewards an agent that did nothing useful")
        return f"{what} earned at most {bounds.baseline:g} on {len(tasks)} tasks"

    async def same_seed_same_episode(self) -> str:
        tasks = await self._tasks()
        for task in tasks:
            try:
                actions = await self._reference(task)
            except Skipped:
                actions = [_reply(JUNK)]
            first = await self._play(task, actions, seed=SEED)
            second = await self._play(task, actions, seed=SEED)
            differ = _first_difference(first.messages, second.messages)
            check(differ is None, f"{task.split}/{task.index} with seed {SEED} twice: {differ}")
            check(first.step_rewards == second.step_rewards and _close(first.grade.value, second.grade.value),
                  f"{task.split}/{task.index} with seed {SEED} twice: rewards {first.step_rewards} and "
                  f"{second.step_rewards}, grades {first.grade.value:g} and {second.grade.value:g}")
        return f"{len(tasks)} tasks played twice with seed {SEED}: the same observations and rewards"

    async def rewards_in_range(self) -> str:
        bounds = await self._range()
        await self._reference_episodes()
        for task in await self._tasks():
            await self._play(task, [_reply(JUNK)])
        outside = [(where, value) for where, value in self._seen
                   if not bounds.min - TOLERANCE <= value <= bounds.max + TOLERANCE]
        check(not outside, f"{len(outside)} rewards outside {_text(bounds)}, e.g. {outside[0][1]:g} from "
                           f"{outside[0][0]}" if outside else "")
        return f"{len(self._seen)} rewards seen, all within [{bounds.min:g}, {bounds.max:g}]"

    async def verify_stored_agrees(self) -> str:
        await self._describe()
        if "verify.trajectory" not in self.capabilities:
            raise Skipped("the server does not advertise verify.trajectory")
        info = await self._describe()
        episodes = await self._reference_episodes()
        for episode in episodes:
            stored = env_pb2.StoredTrajectory(env=info.name, task_ref=episode.task_ref, messages=episode.messages)
            try:
                graded = await self.stub.Verify(env_pb2.VerifyRequest(request_id=_id(), trajectory=stored),
                                                timeout=self.timeout_s)
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                    raise Skipped(f"{info.name!r} grades live episodes only: {error.details()}") from None
                raise CheckFailed(f"Verify of the stored {episode.task} failed: {error.code().name}: "
                                  f"{error.details()}") from None
            check(graded.reward.status == episode.grade.status and _close(graded.reward.value, episode.grade.value),
                  f"{episode.task} stored: {_grade(graded.reward)}, live: {_grade(episode.grade)}")
        return f"{len(episodes)} stored reference episodes graded as they were live"

    def checks(self) -> list[tuple[str, Check]]:
        return [
            ("reward_range_declared", self.reward_range_declared),
            ("reference_reaches_max", self.reference_reaches_max),
            ("do_nothing_gets_baseline", self.do_nothing_gets_baseline),
            ("garbage_gets_baseline", self.garbage_gets_baseline),
            ("same_seed_same_episode", self.same_seed_same_episode),
            ("rewards_in_range", self.rewards_in_range),
            ("verify_stored_agrees", self.verify_stored_agrees),
        ]


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=0.0, abs_tol=TOLERANCE)


def _text(bounds: env_pb2.RewardRange) -> str:
    return f"min {bounds.min:g}, baseline {bounds.baseline:g}, max {bounds.max:g}"


def _grade(reward: common_pb2.Reward) -> str:
    status = common_pb2.RewardStatus.Name(reward.status).removeprefix("REWARD_STATUS_")
    return f"{status} {reward.value:g}" + (f" ({reward.detail})" if reward.detail else "")


def _splits(episodes: list[Episode]) -> str:
    return ", ".join(sorted({episode.task.split("/")[0] for episode in episodes}))


def _first_difference(a: list[common_pb2.ChatMessage], b: list[common_pb2.ChatMessage]) -> str | None:
    if len(a) != len(b):
        return f"{len(a)} messages, then {len(b)}"
    for number, (x, y) in enumerate(zip(a, b, strict=True)):
        if x.SerializeToString(deterministic=True) != y.SerializeToString(deterministic=True):
            return f"message {number} differs: {x.content[:80]!r} vs {y.content[:80]!r}"
    return None


__all__ = ["SemanticChecks"]
