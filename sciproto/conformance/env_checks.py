"""Conformance checks of an EnvironmentService, over the wire.

Each check is one behaviour `proto/README.md` and the protos promise: the documented statuses
and reasons, idempotent retries, Session multiplexing and close-on-end, backpressure, deadlines,
health and reflection, Verify of live and stored trajectories. The checks pick one environment
(the first the server hosts, or the one asked for) and its first split, and act with a plain
assistant reply, so they need nothing but what Describe says.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

import grpc

from sciproto.channel import ChannelConfig, make_channel
from sciproto.conformance.env_semantic import TASKS_PER_SPLIT, SemanticChecks
from sciproto.conformance.report import Report
from sciproto.conformance.wire import (
    Check,
    CheckFailed,
    Skipped,
    call_fails,
    call_ok,
    check,
    check_health,
    check_reflection,
    decode_rpc_error,
    decode_status,
    expect_error,
    run_checks,
)
from sciproto.pb import ENV_SERVICE, common_pb2, env_grpc, env_pb2

NOT_FOUND, INVALID_ARGUMENT = grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT
MAX_EPISODES_TO_FILL = 64  # backpressure is checked only on servers that hold at most this many
CLOSE_ON_END_WAIT_S = 10.0  # how long a stream's episodes may take to close after it ends (default)


def new_id() -> str:
    return uuid.uuid4().hex


def reply(text: str = "42") -> common_pb2.ChatMessage:
    """A plain assistant reply: an action every environment must accept."""
    return common_pb2.ChatMessage(role=common_pb2.ROLE_ASSISTANT, content=text)


def _minor(version: str) -> int:
    parts = version.split(".")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


class SessionProbe:
    """One Session stream: send an operation, wait for its answer (heartbeats skipped)."""

    def __init__(self, stub: env_grpc.EnvironmentServiceStub, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._outgoing: asyncio.Queue[env_pb2.SessionRequest | None] = asyncio.Queue()
        self._waiting: dict[str, asyncio.Future[env_pb2.SessionResponse]] = {}
        self.heartbeats = 0
        self.stray: list[env_pb2.SessionResponse] = []  # answers to no request sent
        self.call = stub.Session(self._requests())
        self._reader = asyncio.ensure_future(self._read())

    async def _requests(self) -> AsyncIterator[env_pb2.SessionRequest]:
        while (request := await self._outgoing.get()) is not None:
            yield request

    async def _read(self) -> None:
        async for answer in self.call:
            if answer.WhichOneof("result") == "heartbeat":
                self.heartbeats += 1
                continue
            waiting = self._waiting.pop(answer.request_id, None)
            if waiting is None or waiting.done():
                self.stray.append(answer)
            else:
                waiting.set_result(answer)

    def submit(self, request: env_pb2.SessionRequest) -> asyncio.Future[env_pb2.SessionResponse]:
        operation = request.WhichOneof("operation")
        request_id = getattr(request, operation).request_id
        answer: asyncio.Future[env_pb2.SessionResponse] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = answer
        self._outgoing.put_nowait(request)
        return answer

    async def ask(self, request: env_pb2.SessionRequest) -> env_pb2.SessionResponse:
        answer = self.submit(request)
        done, _ = await asyncio.wait([answer, self._reader], timeout=self.timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        if answer in done:
            return answer.result()
        if self._reader in done:
            error = self._reader.exception()
            raise CheckFailed(f"the Session stream ended before answering {request.WhichOneof('operation')}"
                              + (f": {error}" if error else ""))
        raise CheckFailed(f"no Session answer to {request.WhichOneof('operation')} within {self.timeout_s:g} s")

    async def end(self) -> None:
        """Half-close and wait until the server ends the stream."""
        self._outgoing.put_nowait(None)
        try:
            await asyncio.wait_for(self._reader, self.timeout_s)
        except TimeoutError:
            raise CheckFailed(f"the server did not end the Session stream within {self.timeout_s:g} s "
                              "of the client half-closing it") from None

    async def cancel(self) -> None:
        self.call.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError, TimeoutError):
            await asyncio.wait_for(self._reader, self.timeout_s)


def answer_of(response: env_pb2.SessionResponse, kind: str) -> object:
    """The `kind` result of a Session answer; its in-band error as a CheckFailed."""
    result = response.WhichOneof("result")
    if result == "error":
        raise CheckFailed(f"the Session answered {kind} with an error: {decode_status(response.error)}")
    check(result == kind, f"the Session answered {kind} with {result}")
    return getattr(response, kind)


class EnvChecks:
    def __init__(self, channel: grpc.aio.Channel, env: str | None, timeout_s: float,
                 close_wait_s: float = CLOSE_ON_END_WAIT_S) -> None:
        self.channel = channel
        self.close_wait_s = close_wait_s
        self.stub = env_grpc.EnvironmentServiceStub(channel)
        self.wanted_env = env
        self.timeout_s = timeout_s
        self.described: env_pb2.EnvironmentServiceDescribeResponse | None = None
        self.env = ""
        self.split = env_pb2.SplitInfo()
        self._opened: list[str] = []

    # ---------------------------------------------------------------- helpers

    def _require_describe(self) -> env_pb2.EnvironmentServiceDescribeResponse:
        if self.described is None:
            raise CheckFailed("Describe failed, so there is no environment to check")
        return self.described

    def task(self, index: int = 0) -> env_pb2.TaskRef:
        return env_pb2.TaskRef(split=self.split.name, index=index)

    async def reset(self, index: int = 0, request_id: str = "", timeout: float | None = None
                    ) -> env_pb2.ResetResponse:
        self._require_describe()
        request = env_pb2.ResetRequest(request_id=request_id or new_id(), env=self.env, task_ref=self.task(index))
        response: env_pb2.ResetResponse = await call_ok(
            self.stub.Reset(request, timeout=timeout or self.timeout_s), "Reset")
        check(response.episode_id, "Reset answered without an episode_id")
        self._opened.append(response.episode_id)
        return response

    async def step(self, episode_id: str, action: common_pb2.ChatMessage | None = None,
                   request_id: str = "") -> env_pb2.StepResponse:
        request = env_pb2.StepRequest(request_id=request_id or new_id(), episode_id=episode_id,
                                      action=action or reply())
        return await call_ok(self.stub.Step(request, timeout=self.timeout_s), "Step")  # type: ignore[return-value]

    async def close(self, episode_id: str) -> env_pb2.CloseResponse:
        request = env_pb2.CloseRequest(request_id=new_id(), episode_id=episode_id)
        return await call_ok(self.stub.Close(request, timeout=self.timeout_s), "Close")  # type: ignore[return-value]

    async def verify_episode(self, episode_id: str) -> env_pb2.VerifyResponse:
        request = env_pb2.VerifyRequest(request_id=new_id(), episode_id=episode_id)
        return await call_ok(self.stub.Verify(request, timeout=self.timeout_s), "Verify")  # type: ignore[return-value]

    async def describe_now(self) -> env_pb2.EnvironmentServiceDescribeResponse:
        return await call_ok(  # type: ignore[return-value]
            self.stub.Describe(env_pb2.EnvironmentServiceDescribeRequest(request_id=new_id()), timeout=self.timeout_s),
            "Describe")

    async def wait_closed(self, episode_id: str, what: str) -> None:
        """Poll (read-only Verify) until `episode_id` is gone, or fail after `close_wait_s`."""
        deadline = asyncio.get_running_loop().time() + self.close_wait_s
        while True:
            request = env_pb2.VerifyRequest(request_id=new_id(), episode_id=episode_id)
            try:
                await self.stub.Verify(request, timeout=self.timeout_s)
            except grpc.aio.AioRpcError as error:
                expect_error(decode_rpc_error(error), NOT_FOUND, "EPISODE_NOT_FOUND")
                return
            if asyncio.get_running_loop().time() > deadline:
                raise CheckFailed(f"episode {episode_id} is still open {self.close_wait_s:g} s after {what}")
            await asyncio.sleep(0.1)

    async def cleanup(self) -> None:
        """Close what the checks opened (episodes a check already closed answer closed=false)."""
        for episode_id in self._opened:
            with contextlib.suppress(grpc.aio.AioRpcError, TimeoutError):
                await self.stub.Close(env_pb2.CloseRequest(request_id=new_id(), episode_id=episode_id),
                                      timeout=self.timeout_s)
        self._opened.clear()

    # ---------------------------------------------------------------- checks

    async def describe(self) -> str:
        described = await self.describe_now()
        version = described.server.protocol_version
        check(version.split(".")[0] == "1", f"protocol_version {version!r} is not 1.x")
        check(described.environments, "Describe lists no environments")
        by_name = {env.name: env for env in described.environments}
        if self.wanted_env is not None:
            check(self.wanted_env in by_name, f"the server hosts no {self.wanted_env!r}; it hosts {sorted(by_name)}")
        candidates = [by_name[self.wanted_env]] if self.wanted_env else list(described.environments)
        for env in candidates:
            usable = [split for split in env.splits if split.size > 0 or split.unbounded]
            if usable:
                self.env, self.split = env.name, usable[0]
                break
        else:
            raise CheckFailed("no hosted environment has a split with tasks")
        self.described = described
        return (f"protocol {version}, {len(described.environments)} environments; checking "
                f"{self.env}:{self.split.name}")

    async def health(self) -> str:
        return await check_health(self.channel, ENV_SERVICE, self.timeout_s)

    async def reflection(self) -> str:
        return await check_reflection(self.channel, ENV_SERVICE, self.timeout_s)

    async def episode_lifecycle(self) -> str:
        reset = await self.reset()
        check(reset.observations, "Reset returned no observations")
        step = await self.step(reset.episode_id)
        check(step.step_count == 1, f"the first Step reports step_count {step.step_count}, not 1")
        check(step.reward.status != common_pb2.REWARD_STATUS_UNSPECIFIED, "the Step's reward has no status")
        first, again = await self.verify_episode(reset.episode_id), await self.verify_episode(reset.episode_id)
        check(first.reward.status != common_pb2.REWARD_STATUS_UNSPECIFIED, "Verify's reward has no status")
        check(first == again, f"Verify is not re-runnable: {first} then {again}")
        check((await self.close(reset.episode_id)).closed, "Close of an open episode answered closed=false")
        check(not (await self.close(reset.episode_id)).closed, "a second Close answered closed=true")
        await call_fails(self.stub.Step(env_pb2.StepRequest(request_id=new_id(), episode_id=reset.episode_id,
                                                            action=reply()), timeout=self.timeout_s),
                         NOT_FOUND, "EPISODE_NOT_FOUND")
        status = common_pb2.RewardStatus.Name(first.reward.status)
        return f"reset, step, verify ({status} {first.reward.value:g}), close, close again"

    async def unknown_environment(self) -> str:
        await call_fails(self.stub.Reset(env_pb2.ResetRequest(request_id=new_id(), env="no-such-environment",
                                                              task_ref=self.task()), timeout=self.timeout_s),
                         NOT_FOUND, "UNKNOWN_ENVIRONMENT")
        return "NOT_FOUND/UNKNOWN_ENVIRONMENT"

    async def unknown_split(self) -> str:
        self._require_describe()
        request = env_pb2.ResetRequest(request_id=new_id(), env=self.env,
                                       task_ref=env_pb2.TaskRef(split="no-such-split", index=0))
        await call_fails(self.stub.Reset(request, timeout=self.timeout_s), NOT_FOUND, "UNKNOWN_SPLIT")
        return "NOT_FOUND/UNKNOWN_SPLIT"

    async def task_out_of_range(self) -> str:
        self._require_describe()
        if self.split.unbounded:
            raise Skipped(f"split {self.split.name!r} is unbounded")
        request = env_pb2.ResetRequest(request_id=new_id(), env=self.env, task_ref=self.task(self.split.size))
        await call_fails(self.stub.Reset(request, timeout=self.timeout_s), INVALID_ARGUMENT, "TASK_OUT_OF_RANGE")
        return f"index {self.split.size}: INVALID_ARGUMENT/TASK_OUT_OF_RANGE"

    async def missing_task(self) -> str:
        self._require_describe()
        await call_fails(self.stub.Reset(env_pb2.ResetRequest(request_id=new_id(), env=self.env),
                                         timeout=self.timeout_s), INVALID_ARGUMENT, "INVALID_REQUEST")
        await call_fails(self.stub.Verify(env_pb2.VerifyRequest(request_id=new_id()), timeout=self.timeout_s),
                         INVALID_ARGUMENT, "INVALID_REQUEST")
        return "Reset without a task, Verify without a target: INVALID_ARGUMENT/INVALID_REQUEST"

    async def episode_not_found(self) -> str:
        missing = f"no-such-episode-{new_id()}"
        await call_fails(self.stub.Step(env_pb2.StepRequest(request_id=new_id(), episode_id=missing, action=reply()),
                                        timeout=self.timeout_s), NOT_FOUND, "EPISODE_NOT_FOUND")
        await call_fails(self.stub.Verify(env_pb2.VerifyRequest(request_id=new_id(), episode_id=missing),
                                          timeout=self.timeout_s), NOT_FOUND, "EPISODE_NOT_FOUND")
        closed = await self.close(missing)
        check(not closed.closed, "Close of an unknown episode answered closed=true")
        return "Step and Verify: NOT_FOUND/EPISODE_NOT_FOUND; Close: closed=false"

    async def invalid_action(self) -> str:
        reset = await self.reset()
        user = common_pb2.ChatMessage(role=common_pb2.ROLE_USER, content="42")
        await call_fails(self.stub.Step(env_pb2.StepRequest(request_id=new_id(), episode_id=reset.episode_id,
                                                            action=user), timeout=self.timeout_s),
                         INVALID_ARGUMENT, "INVALID_ACTION")
        calls = common_pb2.ChatMessage(role=common_pb2.ROLE_ASSISTANT, tool_calls=[
            common_pb2.ToolCall(id="same", name="a", arguments="{}"),
            common_pb2.ToolCall(id="same", name="b", arguments="{}")])
        await call_fails(self.stub.Step(env_pb2.StepRequest(request_id=new_id(), episode_id=reset.episode_id,
                                                            action=calls), timeout=self.timeout_s),
                         INVALID_ARGUMENT, "INVALID_ACTION")
        # Neither was applied: the episode still takes its first step.
        step = await self.step(reset.episode_id)
        check(step.step_count == 1, f"refused actions were counted: the next Step reports step_count {step.step_count}")
        await self.close(reset.episode_id)
        return "a user message and duplicate tool-call ids: INVALID_ARGUMENT/INVALID_ACTION, not applied"

    async def unknown_tool_is_answered(self) -> str:
        reset = await self.reset()
        action = common_pb2.ChatMessage(role=common_pb2.ROLE_ASSISTANT, tool_calls=[
            common_pb2.ToolCall(id="call_1", name="no_such_tool", arguments="{}")])
        step = await self.step(reset.episode_id, action)
        answers = [message for message in step.observations if message.tool_call_id == "call_1"]
        check(answers, "a call to an unknown tool got no tool message answering its id")
        check(answers[0].role == common_pb2.ROLE_TOOL, "the answer to a tool call is not ROLE_TOOL")
        await self.close(reset.episode_id)
        return "answered by a tool message, not an error"

    async def episode_finished(self) -> str:
        reset = await self.reset()
        for _ in range(4):
            step = await self.step(reset.episode_id)
            if step.terminated or step.truncated:
                break
        else:
            await self.close(reset.episode_id)
            raise Skipped("the episode did not end within 4 plain replies")
        await call_fails(self.stub.Step(env_pb2.StepRequest(request_id=new_id(), episode_id=reset.episode_id,
                                                            action=reply()), timeout=self.timeout_s),
                         grpc.StatusCode.FAILED_PRECONDITION, "EPISODE_FINISHED")
        await self.close(reset.episode_id)
        return f"ended after {step.step_count} steps; the next Step: FAILED_PRECONDITION/EPISODE_FINISHED"

    async def reset_retry(self) -> str:
        request_id = new_id()
        first = await self.reset(request_id=request_id)
        again = await self.reset(request_id=request_id)
        check(first.episode_id == again.episode_id,
              f"a retried Reset opened a second episode ({first.episode_id}, then {again.episode_id})")
        await self.close(first.episode_id)
        return "same episode"

    async def step_retry(self) -> str:
        reset = await self.reset()
        request_id, action = new_id(), reply("7")
        first = await self.step(reset.episode_id, action, request_id)
        again = await self.step(reset.episode_id, action, request_id)
        check(again == first, f"a retried Step answered differently: {first} then {again}")
        check(first.step_count == 1, f"step_count is {first.step_count} after one Step")
        # Retries racing the first attempt are answered once too.
        other = await self.reset()
        request_id = new_id()
        racing = await asyncio.gather(*(self.step(other.episode_id, action, request_id) for _ in range(3)))
        check(all(step == racing[0] for step in racing), "concurrent retries of one Step answered differently")
        check(racing[0].step_count == 1, f"concurrent retries stepped the episode {racing[0].step_count} times")
        for episode_id in (reset.episode_id, other.episode_id):
            await self.close(episode_id)
        return "a retry, and 3 racing copies, are answered with the first result; the episode stepped once"

    async def duplicate_request_id(self) -> str:
        request_id = new_id()
        first = await self.reset(request_id=request_id)
        other_task = 1 if self.split.unbounded or self.split.size > 1 else None
        if other_task is None:
            await self.close(first.episode_id)
            raise Skipped(f"split {self.split.name!r} has one task: no other Reset to reuse the id for")
        request = env_pb2.ResetRequest(request_id=request_id, env=self.env, task_ref=self.task(other_task))
        await call_fails(self.stub.Reset(request, timeout=self.timeout_s), INVALID_ARGUMENT, "DUPLICATE_REQUEST")
        await self.close(first.episode_id)
        return "an id reused for another task: INVALID_ARGUMENT/DUPLICATE_REQUEST"

    async def deadline_then_retry(self) -> str:
        opened_before = (await self.describe_now()).counters.episodes_opened
        request_id = new_id()
        request = env_pb2.ResetRequest(request_id=request_id, env=self.env, task_ref=self.task())
        try:
            await self.stub.Reset(request, timeout=0.001)
        except grpc.aio.AioRpcError as error:
            check(error.code() == grpc.StatusCode.DEADLINE_EXCEEDED,
                  f"a Reset past its deadline ended with {error.code().name}, not DEADLINE_EXCEEDED")
        first = await self.reset(request_id=request_id)
        again = await self.reset(request_id=request_id)
        check(first.episode_id == again.episode_id, "retries after a deadline opened different episodes")
        opened = (await self.describe_now()).counters.episodes_opened - opened_before
        check(opened == 1, f"one Reset, its deadline and two retries opened {opened} episodes (counters), not 1")
        await self.close(first.episode_id)
        return "DEADLINE_EXCEEDED, then the retries get one episode"

    async def session_multiplexing(self) -> str:
        self._require_describe()
        session = SessionProbe(self.stub, self.timeout_s)
        try:
            resets = await asyncio.gather(*(session.ask(env_pb2.SessionRequest(reset=env_pb2.ResetRequest(
                request_id=new_id(), env=self.env, task_ref=self.task(index)))) for index in (0, 0)))
            episodes = [answer_of(answer, "reset").episode_id for answer in resets]  # type: ignore[attr-defined]
            self._opened += episodes
            check(len(set(episodes)) == 2, f"two Session resets gave episodes {episodes}")
            check([answer.episode_id for answer in resets] == episodes,
                  "a Session reset answer does not carry its episode_id")
            step_ids = [new_id(), new_id()]
            steps = await asyncio.gather(*(session.ask(env_pb2.SessionRequest(step=env_pb2.StepRequest(
                request_id=request_id, episode_id=episode, action=reply())))
                for request_id, episode in zip(step_ids, episodes, strict=True)))
            for answer, request_id, episode in zip(steps, step_ids, episodes, strict=True):
                check(answer.request_id == request_id and answer.episode_id == episode,
                      "a Session step answer does not echo its request_id and episode_id")
                check(answer_of(answer, "step").step_count == 1, "a Session step did not count one step")  # type: ignore[attr-defined]
            missing = await session.ask(env_pb2.SessionRequest(step=env_pb2.StepRequest(
                request_id=new_id(), episode_id=f"no-such-episode-{new_id()}", action=reply())))
            check(missing.WhichOneof("result") == "error", "a Session step on an unknown episode was not an error")
            expect_error(decode_status(missing.error), NOT_FOUND, "EPISODE_NOT_FOUND")
            verify = await session.ask(env_pb2.SessionRequest(verify=env_pb2.VerifyRequest(
                request_id=new_id(), episode_id=episodes[0])))
            answer_of(verify, "verify")
            close = await session.ask(env_pb2.SessionRequest(close=env_pb2.CloseRequest(
                request_id=new_id(), episode_id=episodes[0])))
            check(answer_of(close, "close").closed, "a Session close answered closed=false")  # type: ignore[attr-defined]
            check(not session.stray, f"the Session sent {len(session.stray)} answers to no request")
            await session.end()
        finally:
            await session.cancel()
        await self.wait_closed(episodes[1], "its Session stream ended")
        return "2 episodes, answers matched by request_id, an in-band error, the stream went on"

    async def session_closes_on_end(self) -> str:
        episode = await self._episode_on_stream(end="half-close")
        await self.wait_closed(episode, "the client half-closed its Session")
        return "episode closed after the client half-closed"

    async def session_closes_on_cancel(self) -> str:
        episode = await self._episode_on_stream(end="cancel")
        await self.wait_closed(episode, "the client cancelled its Session")
        return "episode closed after the client cancelled the stream"

    async def _episode_on_stream(self, end: str) -> str:
        self._require_describe()
        session = SessionProbe(self.stub, self.timeout_s)
        try:
            answer = await session.ask(env_pb2.SessionRequest(reset=env_pb2.ResetRequest(
                request_id=new_id(), env=self.env, task_ref=self.task())))
            episode: str = answer_of(answer, "reset").episode_id  # type: ignore[attr-defined]
            self._opened.append(episode)
            await self.verify_episode(episode)  # open and reachable over unary calls too
            if end == "half-close":
                await session.end()
        finally:
            await session.cancel()
        return episode

    async def provenance(self) -> str:
        described = self._require_describe()
        if _minor(described.server.protocol_version) < 2:
            raise Skipped(f"protocol {described.server.protocol_version} predates provenance (1.2)")
        info = next(env for env in described.environments if env.name == self.env)
        expected = info.provenance
        check(expected.environment == self.env and expected.environment_version and expected.grader_version,
              f"EnvironmentInfo.provenance of {self.env!r} is incomplete: {expected}")
        first, again = await self.reset(), await self.reset()
        check(first.task_id, "ResetResponse.task_id is empty")
        check(first.task_id == again.task_id, f"one task got two task_ids: {first.task_id}, {again.task_id}")
        if self.split.unbounded or self.split.size > 1:
            other = await self.reset(1)
            check(other.task_id != first.task_id, f"tasks 0 and 1 share task_id {first.task_id}")
            await self.close(other.episode_id)
        step = await self.step(first.episode_id)
        verified = await self.verify_episode(first.episode_id)
        for what, reward in (("Step", step.reward), ("Verify", verified.reward)):
            check(reward.provenance == expected, f"the {what} reward's provenance {reward.provenance} is not "
                                                 f"EnvironmentInfo's {expected}")
        for reset in (first, again):
            await self.close(reset.episode_id)
        return f"{expected.environment_version} / {expected.grader_version}; task_id {first.task_id}"

    async def session_cancel(self) -> str:
        described = self._require_describe()
        if "session.cancel" not in described.server.capabilities:
            raise Skipped("the server does not advertise session.cancel (protocol 1.2)")
        session = SessionProbe(self.stub, self.timeout_s)
        try:
            unknown = await session.ask(env_pb2.SessionRequest(cancel=env_pb2.CancelRequest(
                request_id=new_id(), target_request_id=f"never-sent-{new_id()}")))
            check(not answer_of(unknown, "cancel").cancelled,  # type: ignore[attr-defined]
                  "a cancel of a request_id never sent answered cancelled=true")
            reset = answer_of(await session.ask(env_pb2.SessionRequest(reset=env_pb2.ResetRequest(
                request_id=new_id(), env=self.env, task_ref=self.task()))), "reset")
            episode: str = reset.episode_id  # type: ignore[attr-defined]
            self._opened.append(episode)
            step = env_pb2.StepRequest(request_id=new_id(), episode_id=episode, action=reply())
            stepped = session.submit(env_pb2.SessionRequest(step=step))
            stop = await session.ask(env_pb2.SessionRequest(cancel=env_pb2.CancelRequest(
                request_id=new_id(), target_request_id=step.request_id)))
            step_answer = await asyncio.wait_for(stepped, self.timeout_s)
            cancelled = answer_of(stop, "cancel").cancelled  # type: ignore[attr-defined]
            if cancelled:
                check(step_answer.WhichOneof("result") == "error", "a cancelled step was answered with a result")
                expect_error(decode_status(step_answer.error), grpc.StatusCode.CANCELLED, "CANCELLED")
                verified = answer_of(await session.ask(env_pb2.SessionRequest(verify=env_pb2.VerifyRequest(
                    request_id=new_id(), episode_id=episode))), "verify")
                check(verified.reward.status == common_pb2.REWARD_STATUS_INFRA_ERROR,  # type: ignore[attr-defined]
                      "after a cancelled step, Verify does not report INFRA_ERROR")
                outcome = "the step was stopped: CANCELLED, then Verify INFRA_ERROR"
            else:
                answer_of(step_answer, "step")
                outcome = "the step finished first: answered, cancel answered cancelled=false"
            late = await session.ask(env_pb2.SessionRequest(cancel=env_pb2.CancelRequest(
                request_id=new_id(), target_request_id=step.request_id)))
            check(not answer_of(late, "cancel").cancelled,  # type: ignore[attr-defined]
                  "a cancel of an answered operation answered cancelled=true")
            await session.end()
        finally:
            await session.cancel()
        return outcome

    async def session_max_in_flight(self) -> str:
        described = await self.describe_now()
        limit = described.limits.session_max_in_flight
        if not limit:
            raise Skipped("the server reports no session_max_in_flight (protocol 1.2)")
        if limit > 1024:
            raise Skipped(f"session_max_in_flight is {limit}; more than 1024 frames is left to load tests")
        session = SessionProbe(self.stub, self.timeout_s)
        try:
            reset = answer_of(await session.ask(env_pb2.SessionRequest(reset=env_pb2.ResetRequest(
                request_id=new_id(), env=self.env, task_ref=self.task()))), "reset")
            episode: str = reset.episode_id  # type: ignore[attr-defined]
            self._opened.append(episode)
            burst = [session.submit(env_pb2.SessionRequest(verify=env_pb2.VerifyRequest(
                request_id=new_id(), episode_id=episode))) for _ in range(limit + 4)]
            answers = await asyncio.wait_for(asyncio.gather(*burst), self.timeout_s)
            refused = 0
            for answer in answers:
                if answer.WhichOneof("result") == "error":
                    expect_error(decode_status(answer.error), grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 "TOO_MANY_IN_FLIGHT", retry_info=True)
                    refused += 1
                else:
                    answer_of(answer, "verify")
            check(not session.stray, f"{len(session.stray)} answers came for no request (answered twice?)")
            await session.end()
        finally:
            await session.cancel()
        return f"{limit + 4} frames at once against max_in_flight {limit}: all answered, {refused} refused with RetryInfo"

    async def verify_stored_trajectory(self) -> str:
        described = self._require_describe()
        if "verify.trajectory" not in described.server.capabilities:
            raise Skipped("the server does not advertise verify.trajectory")
        reset = await self.reset()
        action = reply()
        step = await self.step(reset.episode_id, action)
        await self.close(reset.episode_id)
        messages = [*reset.observations, action, *step.observations]
        stored = env_pb2.StoredTrajectory(env=self.env, task_ref=self.task(), messages=messages)
        graded: env_pb2.VerifyResponse = await call_ok(self.stub.Verify(
            env_pb2.VerifyRequest(request_id=new_id(), trajectory=stored), timeout=self.timeout_s),
            "Verify of a stored trajectory")
        judged = (common_pb2.REWARD_STATUS_SCORED, common_pb2.REWARD_STATUS_UNSCORED)
        check(graded.reward.status in judged,
              f"a stored trajectory was graded {common_pb2.RewardStatus.Name(graded.reward.status)}")
        detail = f"task_ref: {common_pb2.RewardStatus.Name(graded.reward.status)} {graded.reward.value:g}"
        if "inline_tasks" in described.server.capabilities:
            inline = env_pb2.StoredTrajectory(env=self.env, messages=messages,
                                              inline_task=env_pb2.InlineTask(fields=dict(reset.task_summary)))
            try:
                response = await self.stub.Verify(env_pb2.VerifyRequest(request_id=new_id(), trajectory=inline),
                                                  timeout=self.timeout_s)
                check(response.reward.status in judged, "a stored inline-task trajectory got no judgement")
                detail += "; inline_task: graded"
            except grpc.aio.AioRpcError as error:
                decoded = decode_rpc_error(error)
                # Fields the summary lacks (an answer) are the caller's to give; not grading is not.
                expect_error(decoded, INVALID_ARGUMENT, "INVALID_REQUEST")
                detail += "; inline_task: INVALID_ARGUMENT for the summary's fields"
        return detail

    async def backpressure(self) -> str:
        described = await self.describe_now()
        limit = described.limits.max_live_episodes
        if not limit or limit > MAX_EPISODES_TO_FILL:
            raise Skipped(f"max_live_episodes is {limit or 'unset'}; filling more than "
                          f"{MAX_EPISODES_TO_FILL} episodes is left to load tests")
        room = limit - described.counters.live_episodes
        opened = [await self.reset() for _ in range(room)]
        try:
            request = env_pb2.ResetRequest(request_id=new_id(), env=self.env, task_ref=self.task())
            await call_fails(self.stub.Reset(request, timeout=self.timeout_s), grpc.StatusCode.RESOURCE_EXHAUSTED,
                             "TOO_MANY_EPISODES", retry_info=True)
        finally:
            for reset in opened:
                await self.close(reset.episode_id)
        await self.close((await self.reset()).episode_id)  # room again once episodes close
        return f"Reset number {limit + 1}: RESOURCE_EXHAUSTED/TOO_MANY_EPISODES with RetryInfo"

    def checks(self) -> list[tuple[str, Check]]:
        return [
            ("describe", self.describe),
            ("health", self.health),
            ("reflection", self.reflection),
            ("episode_lifecycle", self.episode_lifecycle),
            ("unknown_environment", self.unknown_environment),
            ("unknown_split", self.unknown_split),
            ("task_out_of_range", self.task_out_of_range),
            ("missing_task_or_target", self.missing_task),
            ("episode_not_found", self.episode_not_found),
            ("invalid_action", self.invalid_action),
            ("unknown_tool_is_answered", self.unknown_tool_is_answered),
            ("episode_finished", self.episode_finished),
            ("reset_retry_is_idempotent", self.reset_retry),
            ("step_retry_is_idempotent", self.step_retry),
            ("duplicate_request_id", self.duplicate_request_id),
            ("deadline_then_retry", self.deadline_then_retry),
            ("session_multiplexing", self.session_multiplexing),
            ("session_closes_episodes_on_end", self.session_closes_on_end),
            ("session_closes_episodes_on_cancel", self.session_closes_on_cancel),
            ("session_cancel", self.session_cancel),
            ("session_max_in_flight", self.session_max_in_flight),
            ("verify_stored_trajectory", self.verify_stored_trajectory),
            ("provenance_and_task_id", self.provenance),
            ("backpressure", self.backpressure),
        ]


async def check_env(config: ChannelConfig, env: str | None = None, timeout_s: float = 30.0,
                    only: list[str] | None = None, close_wait_s: float = CLOSE_ON_END_WAIT_S,
                    semantic: bool = False, tasks_per_split: int = TASKS_PER_SPLIT) -> Report:
    """Run the environment checks against `config.target` (a check runs at most `timeout_s`);
    `only`: names of the checks to run (describe always runs first); `close_wait_s`: how long the
    episodes of an ended or cancelled Session may take to close; `semantic`: also the checks of
    what the environment's rewards mean (sciproto.conformance.env_semantic), on the first
    `tasks_per_split` tasks of every split."""
    report = Report("env", config.target)
    # One attempt per call: the channel's own retries would hide what the server answered.
    async with make_channel(config.model_copy(update={"max_attempts": 1})) as channel:
        checks = EnvChecks(channel, env, timeout_s, close_wait_s)
        every = checks.checks()
        meaning = SemanticChecks(channel, env, timeout_s, tasks_per_split).checks() if semantic else []
        # `--only semantic`: every semantic check (and describe)
        chosen = set(only or ()) | ({name for name, _ in meaning} if "semantic" in (only or ()) else set())
        selected = [(name, run) for name, run in every + meaning
                    if only is None or name == "describe" or name in chosen]
        try:
            await run_checks(report, selected, timeout_s)
        finally:
            await checks.cleanup()
    return report
