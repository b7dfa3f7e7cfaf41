"""EnvironmentService on a real server process: episodes over unary calls and Session streams,
serialization, idempotent retries, deadlines, bad input and error semantics."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from sciproto.client.env import EnvClient, new_request_id, tool_calls_action
from sciproto.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Reason,
)
from sciproto.pb import common_pb2, env_grpc, env_pb2
from sciproto.processes import ServerProcess
from tests.env_servers.answers import expected_answer
from tests.env_servers.conftest import (
    edit_cell,
    live_episodes,
    submit,
    text,
    wait_for_live_episodes,
)

SCORED = common_pb2.REWARD_STATUS_SCORED


def calculator(expr: str) -> common_pb2.ChatMessage:
    return tool_calls_action(("calculator", {"expr": expr}))


async def test_describe_reports_versions_envs_splits_and_limits(env_server: ServerProcess) -> None:
    async with EnvClient(env_server.target) as client:
        described = await client.describe()
        await client.close((await client.reset("gsm8k", split="test", index=1)).episode_id)
        tools = {env.name: [tool.name for tool in env.tools] for env in (await client.describe()).environments}
    assert described.server.protocol_version.startswith("1.")
    assert "session" in described.server.capabilities
    assert described.server.limits.max_receive_message_bytes > 0
    splits = {env.name: {s.name: s.size for s in env.splits} for env in described.environments}
    assert splits["gsm8k"] == {"train": 250, "test": 60, "short_train": 400, "short_test": 100,
                               "short_text_train": 400, "short_text_test": 100}
    assert set(splits) == {"gsm8k", "notebook"}
    assert described.limits.max_live_episodes > 0 and described.limits.idle_ttl_seconds > 0
    assert tools["gsm8k"] == ["calculator", "submit_answer"]  # known once a gsm8k episode was reset


@pytest.mark.parametrize("transport", ["unary", "session"])
async def test_gsm8k_episode_over_unary_calls_and_the_shared_stream(env_server: ServerProcess, transport: str) -> None:
    async with EnvClient(env_server.target, transport=transport) as client:
        reset = await client.reset("gsm8k", split="test", index=0)
        assert [tool.name for tool in reset.tools] == ["calculator", "submit_answer"]
        assert reset.observations[0].content == reset.task_summary["question"]
        schema = reset.tools[0].parameters_json_schema
        assert '"expr"' in schema and '"object"' in schema

        step = await client.step(reset.episode_id, calculator("6 * 7"))
        assert (step.observations[0].role, step.observations[0].content) == (common_pb2.ROLE_TOOL, "42")
        assert (step.terminated, step.step_count) == (False, 1)

        assert "answer" not in reset.task_summary  # the agent never sees the answer
        step = await client.step(reset.episode_id, submit(expected_answer("gsm8k", "test", 0)))
        assert (step.reward.value, step.reward.status, step.terminated) == (1.0, SCORED, True)

        verified = await client.verify(reset.episode_id)
        assert (verified.reward.value, verified.reward.status) == (1.0, SCORED)
        with pytest.raises(FailedPrecondition) as finished:
            await client.step(reset.episode_id, calculator("1"))
        assert finished.value.reason == Reason.EPISODE_FINISHED
        assert (await client.close(reset.episode_id)).closed
        assert not (await client.close(reset.episode_id)).closed  # closing twice is fine


async def test_an_episode_without_an_answer_is_graded_as_a_wrong_one(env_server: ServerProcess) -> None:
    """An agent out of budget before submit_answer gets GSM8K's wrong-answer reward, SCORED, so that
    a policy that never answers is trained away from it instead of masked out."""
    async with EnvClient(env_server.target) as client:
        reset = await client.reset("gsm8k", split="test", index=3)
        step = await client.step(reset.episode_id, calculator("6 * 7"))
        verified = await client.verify(reset.episode_id)
        await client.close(reset.episode_id)
    assert not step.terminated
    assert (verified.reward.value, verified.reward.status) == (0.0, SCORED)
    assert dict(verified.reward.components) == {"correct": 0.0, "submitted": 0.0}
    assert "without an answer" in verified.reward.detail


async def test_plain_reply_is_a_message_not_an_empty_tool_request(env_server: ServerProcess) -> None:
    """CalculatorEnv answers a plain reply with its no-tool-calls response (reward 0), while an
    empty tool request would be a failed tool call (reward -1)."""
    async with EnvClient(env_server.target) as client:
        reset = await client.reset("gsm8k", split="test", index=2)
        reply = common_pb2.ChatMessage(role=common_pb2.ROLE_ASSISTANT, content="I think it is 5.")
        step = await client.step(reset.episode_id, reply)
        await client.close(reset.episode_id)
    assert step.reward.value == 0.0 and step.reward.status == SCORED


async def test_a_short_text_episode_offers_no_tool_and_grades_the_plain_reply(env_server: ServerProcess) -> None:
    answer = expected_answer("gsm8k", "short_text_test", 9)
    async with EnvClient(env_server.target) as client:
        reset = await client.reset("gsm8k", split="short_text_test", index=9)
        reply = common_pb2.ChatMessage(role=common_pb2.ROLE_ASSISTANT, content=f"That makes {answer}.")
        step = await client.step(reset.episode_id, reply)
        verified = await client.verify(reset.episode_id)
        await client.close(reset.episode_id)
    assert list(reset.tools) == [] and "number only" in reset.observations[0].content
    assert (step.reward.value, step.reward.status, step.terminated) == (1.0, SCORED, True)
    assert (verified.reward.value, verified.reward.status) == (1.0, SCORED)


async def test_gsm8k_episodes_over_one_session(env_server: ServerProcess) -> None:
    async def episode(session, index: int) -> tuple[float, float]:
        reset = await session.reset("gsm8k", split="train", index=index)
        await session.step(reset.episode_id, calculator("2 + 2"))
        step = await session.step(reset.episode_id, submit(expected_answer("gsm8k", "train", index)))
        verified = await session.verify(reset.episode_id)
        assert (await session.close(reset.episode_id)).closed
        return step.reward.value, verified.reward.value

    async with EnvClient(env_server.target) as client, client.session() as session:
        rewards = await asyncio.gather(*(episode(session, index) for index in range(6)))
    assert rewards == [(1.0, 1.0)] * 6


async def test_notebook_episode_with_correct_answer(env_server: ServerProcess) -> None:
    async with EnvClient(env_server.target) as client, client.session() as session:
        reset = await session.reset("notebook", split="test", index=0)
        assert {tool.name for tool in reset.tools} >= {"edit_cell", "submit_answer"}
        files = reset.task_summary["files"]
        step = await session.step(reset.episode_id, edit_cell(
            f"import json, pandas as pd\nprint([len(pd.read_csv(f)) for f in json.loads({files!r})])"))
        assert step.reward.status == SCORED and not step.terminated
        assert "Cell 0" in text(step.observations) and "Error" not in text(step.observations)
        assert "answer" not in reset.task_summary
        step = await session.step(reset.episode_id, submit(expected_answer("notebook", "test", 0)))
        assert (step.reward.value, step.terminated) == (1.0, True)
        assert dict(step.reward.components) == {"correct": 1.0}


async def test_steps_on_one_episode_are_serialized_and_heartbeats_flow(env_server: ServerProcess) -> None:
    """Two steps sent at once on one episode: the second starts only after the first finished,
    so the first one's notebook shows only its own cell. The slow first step gets heartbeats."""
    async with EnvClient(env_server.target) as client, client.session() as session:
        reset = await session.reset("notebook", split="test", index=1)
        first, second = await asyncio.gather(
            # Printed words joined by print: the outputs, not the sources, contain "first cell ran".
            session.step(reset.episode_id, edit_cell("import time\ntime.sleep(0.8)\nprint('first', 'cell', 'ran')")),
            session.step(reset.episode_id, edit_cell("print('second', 'cell', 'ran')")),
        )
        heartbeat = session.last_heartbeat
    assert (first.step_count, second.step_count) == (1, 2)
    assert "first cell ran" in text(first.observations)
    assert "second cell ran" not in text(first.observations)
    assert "first cell ran" in text(second.observations) and "second cell ran" in text(second.observations)
    assert heartbeat is not None and heartbeat.heartbeat.elapsed_seconds >= 0.2


async def test_a_slow_step_does_not_hold_up_other_episodes(env_server: ServerProcess) -> None:
    async with EnvClient(env_server.target) as client, client.session() as session:
        slow = await session.reset("notebook", split="test", index=2)
        fast = await session.reset("gsm8k", split="test", index=3)
        slow_step = asyncio.ensure_future(session.step(slow.episode_id, edit_cell("import time\ntime.sleep(1.5)")))
        fast_steps = [await session.step(fast.episode_id, calculator(f"{i} + 1")) for i in range(3)]
        assert not slow_step.done()  # three fast steps were answered while the slow one ran
        assert (await slow_step).step_count == 1
    assert [step.observations[0].content for step in fast_steps] == ["1", "2", "3"]


async def test_retried_step_with_same_request_id_steps_once(env_server: ServerProcess) -> None:
    async with EnvClient(env_server.target) as client:
        reset = await client.reset("gsm8k", split="test", index=4)
        steps_before = (await client.describe()).counters.steps
        request_id = new_request_id()
        action = calculator("3 * 3")
        first = await client.step(reset.episode_id, action, request_id=request_id)
        retry = await client.step(reset.episode_id, action, request_id=request_id)
        both = await asyncio.gather(*(client.step(reset.episode_id, action, request_id="same-twice")
                                      for _ in range(2)))
        steps_after = (await client.describe()).counters.steps
        with pytest.raises(InvalidArgument) as reused:
            await client.step(reset.episode_id, calculator("1 + 1"), request_id=request_id)
        await client.close(reset.episode_id)
    assert first == retry and first.step_count == 1
    assert both[0] == both[1] and both[0].step_count == 2
    assert steps_after - steps_before == 2
    assert reused.value.reason == Reason.DUPLICATE_REQUEST


async def test_deadline_is_honoured_and_the_retry_gets_the_first_result(env_server: ServerProcess) -> None:
    async with EnvClient(env_server.target) as client:
        reset = await client.reset("notebook", split="test", index=3)
        request_id = new_request_id()
        slow = edit_cell("import time\ntime.sleep(1.5)\nprint('slept')")
        with pytest.raises(DeadlineExceeded):
            await client.step(reset.episode_id, slow, request_id=request_id, timeout=0.3)
        retry = await client.step(reset.episode_id, slow, request_id=request_id, timeout=30)
        assert retry.step_count == 1 and "slept" in text(retry.observations)
        await client.close(reset.episode_id)


async def test_a_caller_cancelled_mid_write_leaves_the_shared_stream_and_its_episodes_open(
        env_server: ServerProcess) -> None:
    """Cancelling one operation never ends the Session stream the client shares among its
    callers: gRPC cancels a whole call when a write on it is cancelled, and every other episode
    on the stream would be lost. Each cancel lands at another point of the operation (waiting
    for a slot, the write, the answer)."""
    async with EnvClient(env_server.target) as client:
        kept = await client.reset("gsm8k", split="test", index=5)
        for yields in range(8):
            operation = asyncio.ensure_future(client.reset("gsm8k", split="test", index=6))
            for _ in range(yields):
                await asyncio.sleep(0)
            operation.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await operation
            step = await client.step(kept.episode_id, calculator(f"{yields} + 1"))  # the stream lives on
            assert step.observations[0].content == str(yields + 1), f"cancelled after {yields} yields"
        await client.close(kept.episode_id)


async def test_agent_mistakes_get_tool_messages_and_malformed_requests_get_errors(
    env_server: ServerProcess,
) -> None:
    async with EnvClient(env_server.target) as client:
        mistakes = {
            "unknown tool": common_pb2.ToolCall(id="a", name="browser", arguments='{"url": "x"}'),
            "malformed JSON": common_pb2.ToolCall(id="b", name="calculator", arguments='{"expr": "1+'),
            "not an object": common_pb2.ToolCall(id="c", name="calculator", arguments='["1+1"]'),
            "wrong argument": common_pb2.ToolCall(id="d", name="calculator", arguments='{"expression": "1"}'),
            "null argument": common_pb2.ToolCall(id="e", name="submit_answer", arguments='{"answer": null}'),
            "list argument": common_pb2.ToolCall(id="f", name="calculator", arguments='{"expr": ["1", "+", "1"]}'),
        }
        answers = {}
        for mistake, call in mistakes.items():
            reset = await client.reset("gsm8k", split="test", index=5)
            action = common_pb2.ChatMessage(role=common_pb2.ROLE_ASSISTANT, tool_calls=[call])
            step = await client.step(reset.episode_id, action)
            answers[mistake] = step
            await client.close(reset.episode_id)

        reset = await client.reset("gsm8k", split="test", index=5)
        with pytest.raises(InvalidArgument) as wrong_role:
            await client.step(reset.episode_id, common_pb2.ChatMessage(role=common_pb2.ROLE_USER, content="hi"))
        twice = common_pb2.ToolCall(id="same", name="calculator", arguments='{"expr": "1"}')
        with pytest.raises(InvalidArgument) as duplicate_ids:
            await client.step(reset.episode_id, common_pb2.ChatMessage(
                role=common_pb2.ROLE_ASSISTANT, tool_calls=[twice, twice]))
        assert (await client.step(reset.episode_id, calculator("2 * 21"))).observations[0].content == "42"
        await client.close(reset.episode_id)
        assert await live_episodes(env_server.target) == 0

    for mistake, step in answers.items():
        tool_message = step.observations[0]
        assert tool_message.role == common_pb2.ROLE_TOOL, mistake
        assert tool_message.tool_call_id == mistakes[mistake].id, mistake
        assert tool_message.content.startswith("Invalid tool call"), mistake
        assert step.reward.status == SCORED, mistake  # the agent's fault, judged as such
    assert "calculator" in answers["unknown tool"].observations[0].content  # lists the real tools
    assert "not valid JSON" in answers["malformed JSON"].observations[0].content
    assert "expression" in answers["wrong argument"].observations[0].content
    assert "'answer' of 'submit_answer' must be a string, got null" in answers["null argument"].observations[0].content
    assert "must be a string" in answers["list argument"].observations[0].content
    assert wrong_role.value.reason == duplicate_ids.value.reason == Reason.INVALID_ACTION
    assert env_server.alive()


async def test_unknown_names_and_indices_say_what_exists(env_server: ServerProcess) -> None:
    async with EnvClient(env_server.target) as client:
        with pytest.raises(NotFound) as env:
            await client.reset("chess", split="test", index=0)
        with pytest.raises(NotFound) as split:
            await client.reset("gsm8k", split="validation", index=0)
        with pytest.raises(InvalidArgument) as index:
            await client.reset("gsm8k", split="test", index=60)
        with pytest.raises(NotFound) as episode:
            await client.step("no-such-episode", calculator("1"))
        with pytest.raises(InvalidArgument) as inline:
            await client.reset("gsm8k", inline={"question": "What is 2 + 2?"})
    assert env.value.reason == Reason.UNKNOWN_ENVIRONMENT and "gsm8k" in env.value.message
    assert split.value.reason == Reason.UNKNOWN_SPLIT and "test" in split.value.message
    assert index.value.reason == Reason.TASK_OUT_OF_RANGE and "60 tasks" in index.value.message
    assert episode.value.reason == Reason.EPISODE_NOT_FOUND and "expired" in episode.value.message
    assert "answer" in inline.value.message


async def test_session_answers_errors_in_band_and_keeps_going(env_server: ServerProcess) -> None:
    async with EnvClient(env_server.target) as client, client.session() as session:
        with pytest.raises(NotFound) as missing:
            await session.step("no-such-episode", calculator("1"))
        with pytest.raises(InvalidArgument):
            await session.reset("gsm8k", split="test", index=999)
        reset = await session.reset("gsm8k", split="test", index=6)
        assert (await session.step(reset.episode_id, calculator("5 - 3"))).observations[0].content == "2"
    assert missing.value.reason == Reason.EPISODE_NOT_FOUND


async def test_verify_stored_trajectories(env_server: ServerProcess) -> None:
    async with EnvClient(env_server.target) as client:
        reset = await client.reset("gsm8k", split="test", index=7)
        answer = expected_answer("gsm8k", "test", 7)
        await client.close(reset.episode_id)
        trajectory = env_pb2.StoredTrajectory(
            env="gsm8k", task_ref=env_pb2.TaskRef(split="test", index=7),
            messages=[*reset.observations, submit(answer)])
        rescored = await client.verify(trajectory=trajectory)
        del trajectory.messages[-1]
        trajectory.messages.append(submit(str(float(answer) + 1)))
        wrong = await client.verify(trajectory=trajectory)
        # A trajectory of an inline task is graded against the fields it was run on.
        inline_task = env_pb2.InlineTask(fields={"question": "What is 6 * 7?", "answer": "#### 42"})
        inline = env_pb2.StoredTrajectory(env="gsm8k", inline_task=inline_task, messages=[submit("42")])
        inline_right = await client.verify(trajectory=inline)
        inline.messages[-1].CopyFrom(submit("41"))
        inline_wrong = await client.verify(trajectory=inline)
        incomplete = env_pb2.StoredTrajectory(env="gsm8k", inline_task=env_pb2.InlineTask(fields={"question": "q"}))
        with pytest.raises(InvalidArgument) as missing_field:
            await client.verify(trajectory=incomplete)
        with pytest.raises(InvalidArgument) as no_task:
            await client.verify(trajectory=env_pb2.StoredTrajectory(env="gsm8k", messages=[submit("1")]))
    assert (rescored.reward.value, rescored.reward.status) == (1.0, SCORED)
    assert dict(rescored.reward.components) == {"correct": 1.0, "submitted": 1.0}
    assert wrong.reward.value == 0.0
    assert (inline_right.reward.value, inline_right.reward.status) == (1.0, SCORED)
    assert (inline_wrong.reward.value, inline_wrong.reward.status) == (0.0, SCORED)
    assert missing_field.value.reason == Reason.INVALID_REQUEST and "answer" in missing_field.value.message
    assert no_task.value.reason == Reason.INVALID_REQUEST


async def test_closing_or_cancelling_a_session_closes_its_episodes(env_server: ServerProcess) -> None:
    async with EnvClient(env_server.target) as client:
        outside = await client.reset("gsm8k", split="test", index=8)  # not the stream's to close
        async with client.session() as session:
            for index in range(3):
                await session.reset("gsm8k", split="test", index=index)
            assert await live_episodes(env_server.target) == 4
        assert await wait_for_live_episodes(env_server.target, 1) == 1

        async with client.session() as session:
            await session.reset("notebook", split="test", index=4)
            await session.reset("gsm8k", split="test", index=9)
            session._call.cancel()  # as a client that dies would
        assert await wait_for_live_episodes(env_server.target, 1) == 1
        assert (await client.step(outside.episode_id, calculator("1 + 1"))).step_count == 1
        await client.close(outside.episode_id)


async def test_raw_session_stream_echoes_request_ids(env_server: ServerProcess) -> None:
    """The wire contract without the Python client: answers carry request_id and episode_id,
    and half-closing the stream ends it after the last answer."""
    async with grpc.aio.insecure_channel(env_server.target) as channel:
        call = env_grpc.EnvironmentServiceStub(channel).Session(timeout=30)
        await call.write(env_pb2.SessionRequest(reset=env_pb2.ResetRequest(
            request_id="r1", env="gsm8k", task_ref=env_pb2.TaskRef(split="test", index=10))))
        reset = await call.read()
        await call.write(env_pb2.SessionRequest(step=env_pb2.StepRequest(
            request_id="s1", episode_id=reset.reset.episode_id, action=calculator("7 * 6"))))
        await call.write(env_pb2.SessionRequest())  # no operation: an in-band error
        await call.done_writing()
        answers = []
        while (answer := await call.read()) is not grpc.aio.EOF:
            answers.append(answer)
    assert (reset.request_id, reset.episode_id) == ("r1", reset.reset.episode_id)
    by_kind = {answer.WhichOneof("result"): answer for answer in answers}
    assert by_kind["step"].request_id == "s1" and by_kind["step"].episode_id == reset.reset.episode_id
    assert by_kind["step"].step.observations[0].content == "42"
    assert by_kind["error"].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]


async def test_undecodable_session_frame_ends_the_stream_with_invalid_argument(env_server: ServerProcess) -> None:
    """A frame that is not a SessionRequest has no request_id to answer in-band: the stream
    ends with INVALID_ARGUMENT, and the episode it had opened is closed."""
    before = await live_episodes(env_server.target)
    reset = env_pb2.SessionRequest(reset=env_pb2.ResetRequest(
        request_id=new_request_id(), env="gsm8k", task_ref=env_pb2.TaskRef(split="test", index=11)))
    # Field 1 (reset) declared as a length-delimited field of 50 bytes, with 2 bytes present.
    garbage = b"\x0a\x32\x08\x01"
    async with grpc.aio.insecure_channel(env_server.target) as channel:
        session = channel.stream_stream("/sciproto.v1.EnvironmentService/Session",
                                        request_serializer=lambda wire: wire,
                                        response_deserializer=env_pb2.SessionResponse.FromString)
        call = session(timeout=30)
        await call.write(reset.SerializeToString())
        assert (await call.read()).WhichOneof("result") == "reset"
        await call.write(garbage)
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            while await call.read() is not grpc.aio.EOF:
                pass
    assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid message" in ended.value.details()
    assert await wait_for_live_episodes(env_server.target, before) == before


async def test_rewards_and_environments_carry_provenance_and_tasks_a_stable_id(env_server: ServerProcess) -> None:
    async with EnvClient(env_server.target) as client:
        described = {env.name: env for env in (await client.describe()).environments}
        first = await client.reset("gsm8k", split="test", index=2)
        again = await client.reset("gsm8k", split="test", index=2)
        other = await client.reset("gsm8k", split="test", index=3)
        step = await client.step(first.episode_id, submit("1"))
        verified = await client.verify(first.episode_id)
        stored = await client.verify(trajectory=env_pb2.StoredTrajectory(
            env="gsm8k", task_ref=env_pb2.TaskRef(split="test", index=2), messages=[submit("1")]))
        inline_fields = {"question": "What is 6 * 7?", "answer": "#### 42"}
        inline = await client.reset("gsm8k", inline=inline_fields)
        for reset in (first, again, other, inline):
            await client.close(reset.episode_id)
    gsm8k = described["gsm8k"].provenance
    assert gsm8k.environment == "gsm8k" and gsm8k.environment_version.startswith("gsm8k/1+aviary-")
    assert gsm8k.grader_version and described["notebook"].provenance.environment == "notebook"
    for reward in (step.reward, verified.reward, stored.reward):
        assert reward.provenance == gsm8k
    assert first.task_id == again.task_id != other.task_id
    assert first.task_id.startswith("gsm8k:") and len(first.task_id) == len("gsm8k:") + 16
    assert inline.task_id.startswith("gsm8k:") and inline.task_id not in (first.task_id, other.task_id)


async def test_a_notebook_figure_comes_back_as_an_image_part(env_server: ServerProcess) -> None:
    async with EnvClient(env_server.target) as client, client.session() as session:
        reset = await session.reset("notebook", split="test", index=3)
        plot = "import matplotlib.pyplot as plt\nplt.plot([1, 4, 9])\nplt.title('squares')\nplt.show()"
        step = await session.step(reset.episode_id, edit_cell(plot))
        await session.close(reset.episode_id)
    with_parts = [message for message in step.observations if message.parts]
    assert with_parts, [message.content[:200] for message in step.observations]
    parts = with_parts[-1].parts
    images = [part.image for part in parts if part.WhichOneof("part") == "image"]
    assert images and images[0].mime_type == "image/png" and images[0].data.startswith(b"\x89PNG\r\n\x1a\n")
    texts = [part.text for part in parts if part.WhichOneof("part") == "text"]
    assert with_parts[-1].content == "\n".join(texts)  # the text parts, without the image's base64
    assert "base64" not in with_parts[-1].content and len(with_parts[-1].content) < 20_000
