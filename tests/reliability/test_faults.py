"""Faults on real processes: a policy server restarted under a running collection, weight updates
cut off midway (cancelled, and the sender killed), SIGTERM to an env server with steps in
flight, and client deadlines shorter than a slow step."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Self

import pytest
from reliability_servers import ARTIFACTS

from sciproto.channel import ChannelConfig
from sciproto.client.env import EnvClient, new_request_id
from sciproto.client.policy import PolicyClient, distinct_tensors, generate_request
from sciproto.errors import DeadlineExceeded, FailedPrecondition, Reason, Unavailable
from sciproto.models import load_model
from sciproto.pb import common_pb2, policy_pb2
from sciproto.processes import ServerProcess, sciproto_command, start_server
from sciproto.weights.wire import (
    chunk_parts,
    data_message_wire,
    header_for,
    serialize_request,
)
from tests.conftest import NOTEBOOK_SANDBOX
from tests.env_servers.conftest import edit_cell

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[2]
POLICY_ARGS = ["serve", "policy", "--model", "tiny", "--set", "weights.chunk_timeout_s=10"]
NOTEBOOK_ARGS = ["serve", "env", "--env", "notebook", "--port", "0", "--set", "server.grace_period_s=15",
                 "--set", f"env_options.notebook.sandbox={NOTEBOOK_SANDBOX}"]
SLOW_CELL_S = 3.0
INFRA_ERROR = common_pb2.REWARD_STATUS_INFRA_ERROR


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout_s:g} s")
        time.sleep(0.1)


# ---------------------------------------------------------------- (a) policy restart under collect


def rollout_ids(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [json.loads(line)["rollout_id"] for line in path.read_text().splitlines() if line.strip()]


def test_policy_server_restarted_during_collection(tmp_path: Path) -> None:
    tasks, samples = 8, 2
    port = free_port()
    env = start_server(["serve", "env", "--env", "toy", "--port", "0"])
    policy = start_server([*POLICY_ARGS, "--port", str(port)])
    output, failures = tmp_path / "toy.jsonl", tmp_path / "toy.failures.jsonl"
    command = sciproto_command("collect", "--env", env.target, "--policy", policy.target, "--tasks", "toy:train",
                               "--output", str(output), "--limit", str(tasks), "--samples", str(samples),
                               "--concurrency", "4", "--set", "progress=false", "--set", "sampling.max_tokens=24",
                               "--set", "max_steps=1", "--set", "replicas.wait_for_healthy_s=60")
    log = (ARTIFACTS / "collect-under-policy-restart.log").open("w")
    try:
        collect = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        wait_until(lambda: len(rollout_ids(output)) >= 2 or collect.poll() is not None, 180, "no rollout written")
        written_before_kill = len(rollout_ids(output))
        assert collect.poll() is None, "the collection finished before the policy server could be restarted"
        policy.kill()
        policy = start_server([*POLICY_ARGS, "--port", str(port)])
        assert collect.wait(timeout=300) == 0, "collect failed; see .test-artifacts/collect-under-policy-restart.log"

        expected = {f"toy/train/{index}/{sample}" for index in range(tasks) for sample in range(samples)}
        seen = Counter(rollout_ids(output) + rollout_ids(failures))
        assert set(seen) == expected and max(seen.values()) == 1, f"missing or doubled: {seen}"
        assert written_before_kill < len(expected)
    finally:
        log.close()
        policy.stop()
        env.stop()


# ---------------------------------------------------------------- (b) weight updates cut off


@pytest.fixture(scope="module")
def policy_server() -> Iterator[ServerProcess]:
    server = start_server([*POLICY_ARGS, "--port", "0"])
    yield server
    server.stop()


async def greedy(client: PolicyClient) -> tuple[int, list[int]]:
    group = await client.generate_group(generate_request(prompt_token_ids=[5, 6, 7, 8], temperature=0.0,
                                                         max_tokens=12), timeout_s=60)
    return group.policy_version, list(group.samples[0].completion_token_ids)


async def full_update(client: PolicyClient, version: int, attempts: int = 50) -> policy_pb2.UpdateWeightsResponse:
    """Push new weights (the tiny model scaled), waiting while the server still holds a broken
    update's lock (it notices a dead sender when its connection drops)."""
    weights = {name: tensor * 1.5 for name, tensor in distinct_tensors(load_model("tiny", seed=0).model.state_dict()).items()}
    for _ in range(attempts):
        try:
            return await client.push_weights(weights, version, chunk_bytes=64 * 1024, timeout_s=60)
        except FailedPrecondition as error:
            if error.reason != Reason.UPDATE_IN_PROGRESS:
                raise
            await asyncio.sleep(0.2)
    raise AssertionError(f"the server refused updates as in progress {attempts} times in a row")


async def test_cancelled_and_killed_weight_updates_leave_the_old_weights(policy_server: ServerProcess) -> None:
    async with PolicyClient(policy_server.target) as client:
        version, completion = await greedy(client)

        # 1. The client cancels the stream after sending half the chunks.
        weights = distinct_tensors(load_model("tiny", seed=0).model.state_dict())
        chunks = [data_message_wire(parts) for parts in chunk_parts(weights, 16 * 1024)]
        half_sent = asyncio.Event()

        async def half_then_hang() -> AsyncIterator[policy_pb2.UpdateWeightsRequest | bytes]:
            yield policy_pb2.UpdateWeightsRequest(header=header_for(weights, version + 1))
            for chunk in chunks[: len(chunks) // 2]:
                yield chunk
            half_sent.set()
            await asyncio.Event().wait()  # never sends the rest

        send = client.channel.stream_unary("/sciproto.v1.PolicyService/UpdateWeights",
                                           request_serializer=serialize_request,
                                           response_deserializer=policy_pb2.UpdateWeightsResponse.FromString)
        call = send(half_then_hang(), timeout=60)
        await asyncio.wait_for(half_sent.wait(), 30)
        await asyncio.sleep(0.3)  # let the sent half reach the server
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert await greedy(client) == (version, completion), "a cancelled update changed what is served"

        # 2. The sending process is SIGKILLed halfway.
        pusher = await asyncio.create_subprocess_exec(
            sys.executable, str(Path(__file__).with_name("half_push.py")), policy_server.target, str(version + 1),
            stdout=asyncio.subprocess.PIPE, cwd=REPO)
        try:
            assert pusher.stdout is not None
            assert (await asyncio.wait_for(pusher.stdout.readline(), 120)).strip() == b"HALF"
            await asyncio.sleep(0.3)
            pusher.send_signal(signal.SIGKILL)
        finally:
            if pusher.returncode is None:
                pusher.kill()
            await asyncio.wait_for(pusher.wait(), 10)
        assert await greedy(client) == (version, completion), "a killed sender's update changed what is served"

        # 3. A later full update goes through.
        applied = await full_update(client, version + 1)
        assert applied.policy_version == version + 1
        assert applied.bytes_received == sum(t.numel() * t.element_size() for t in weights.values())
        new_version, _ = await greedy(client)
        assert new_version == version + 1
        assert (await client.describe()).active_requests == 0
    assert policy_server.alive()


# ---------------------------------------------------------------- (d) deadlines


@pytest.fixture(scope="module")
def notebook_server() -> Iterator[ServerProcess]:
    server = start_server(NOTEBOOK_ARGS)
    yield server
    server.stop()


async def counters(client: EnvClient):
    return (await client.describe(timeout=10)).counters


@pytest.mark.parametrize("transport", ["unary", "session"])
async def test_client_deadline_shorter_than_a_slow_step(notebook_server: ServerProcess, transport: str) -> None:
    async with EnvClient(notebook_server.target, transport=transport) as client:
        live_before = (await counters(client)).live_episodes
        reset = await client.reset("notebook", split="test", index=1)
        steps_before = (await counters(client)).steps
        slow = edit_cell(f"import time\ntime.sleep({SLOW_CELL_S})\nprint('slept')")
        with pytest.raises(DeadlineExceeded):
            await client.step(reset.episode_id, slow, request_id=new_request_id(), timeout=0.5)
        # The deadline fired before the step ended: the server has not counted it yet.
        assert (await counters(client)).steps == steps_before
        # The step finishes in the background; the episode goes on from there.
        deadline = time.monotonic() + 60
        while (await counters(client)).steps == steps_before and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        after = await client.step(reset.episode_id, edit_cell("print(1 + 1)"), timeout=60)
        assert after.step_count == 2 and after.reward.status != INFRA_ERROR
        assert (await counters(client)).live_episodes == live_before + 1
        assert (await client.close(reset.episode_id)).closed
        assert (await counters(client)).live_episodes == live_before


async def test_session_deadline_then_stream_end_closes_the_busy_episode(notebook_server: ServerProcess) -> None:
    async with EnvClient(notebook_server.target) as client:
        live_before = (await counters(client)).live_episodes
        async with client.session() as session:
            reset = await session.reset("notebook", split="test", index=2)
            with pytest.raises(DeadlineExceeded):
                await session.step(reset.episode_id, edit_cell(f"import time\ntime.sleep({SLOW_CELL_S})"), timeout=0.5)
            assert (await counters(client)).live_episodes == live_before + 1
        deadline = time.monotonic() + 60
        while (live := (await counters(client)).live_episodes) != live_before and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert live == live_before, "the episode of an ended session is still open"
        # The server is consistent: a new episode runs normally.
        again = await client.reset("notebook", split="test", index=2)
        # The cell's output (not its source) must come back: a missed IOPub subscription
        # used to leave the step waiting out the 60 s cell timeout here.
        step = await client.step(again.episode_id, edit_cell("print(6 * 7)"), timeout=60)
        assert step.step_count == 1 and any("42" in m.content for m in step.observations), step
        await client.close(again.episode_id)


# ---------------------------------------------------------------- (e) EnvClient's shared stream cut


class DroppingProxy:
    """A loopback TCP forwarder whose connections can be cut at once, as a network would."""

    def __init__(self, target: str) -> None:
        self.host, port = target.rsplit(":", 1)
        self.upstream_port = int(port)
        self.writers: set[asyncio.StreamWriter] = set()
        self.connections = 0

    async def __aenter__(self) -> Self:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.target = f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.server.close()
        self.drop()
        await asyncio.wait_for(self.server.wait_closed(), 10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection(self.host, self.upstream_port)
        self.writers |= {writer, up_writer}

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, OSError):
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            sink.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self.writers -= {writer, up_writer}

    def drop(self) -> None:
        for writer in list(self.writers):
            writer.transport.abort()  # RST: the peer sees the connection reset
        self.writers.clear()


async def fails_at_once_under_a_slow_step(client: EnvClient, episode_id: str,
                                          fault: Callable[[], Awaitable[None]]) -> None:
    """A step that sleeps SLOW_CELL_S in its kernel; `fault()` once it runs; the step fails with
    UNAVAILABLE at once, not at its 60 s deadline."""
    slow = asyncio.ensure_future(client.step(
        episode_id, edit_cell(f"import time\ntime.sleep({SLOW_CELL_S})"), timeout=60))
    await asyncio.sleep(0.8)  # the step runs in its kernel
    await fault()
    started = time.monotonic()
    with pytest.raises(Unavailable):
        await slow
    assert time.monotonic() - started < 10, "the step in flight waited for its deadline"


async def test_dropped_connection_loses_the_streams_episodes_and_the_next_call_opens_a_new_stream(
    notebook_server: ServerProcess,
) -> None:
    """EnvClient runs its episodes on one Session stream. A dropped connection ends the stream;
    the server closes its episodes (the protocol says so), the client reports them lost with
    the stream's error and its next operation opens a new stream."""
    async with EnvClient(notebook_server.target, transport="unary") as direct, \
            DroppingProxy(notebook_server.target) as proxy, \
            EnvClient(ChannelConfig(target=proxy.target, max_attempts=1)) as client:
        live_before = (await counters(direct)).live_episodes
        reset = await client.reset("notebook", split="test", index=1, timeout=60)
        async def while_stepping() -> None:
            assert (await counters(direct)).live_episodes == live_before + 1
            proxy.drop()

        await fails_at_once_under_a_slow_step(client, reset.episode_id, while_stepping)

        with pytest.raises(Unavailable) as lost:
            await client.step(reset.episode_id, edit_cell("print(1)"), timeout=10)
        assert "opened on a Session stream that ended" in lost.value.message
        assert "start it again from Reset" in lost.value.message
        assert not (await client.close(reset.episode_id)).closed
        # The server closed the episode with its stream.
        deadline = time.monotonic() + 30
        while (live := (await counters(direct)).live_episodes) != live_before and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert live == live_before, "the episode of the cut stream is still open on the server"

        # The next operation opens a new connection and stream; its episodes run as before.
        again = await client.reset("notebook", split="test", index=1, timeout=60)
        step = await client.step(again.episode_id, edit_cell("print(6 * 7)"), timeout=60)
        assert step.step_count == 1 and any("42" in m.content for m in step.observations), step
        assert (await client.close(again.episode_id)).closed
        assert proxy.connections == 2



async def test_the_first_call_after_each_dropped_connection_opens_a_new_stream(notebook_server: ServerProcess) -> None:
    """Right after a cut, gRPC may still hand a new stream to the connection that just closed: that
    stream fails before anything reaches the server. The client opens another (bounded), so a
    Reset made at once after a drop works, every time."""
    async with DroppingProxy(notebook_server.target) as proxy, \
            EnvClient(ChannelConfig(target=proxy.target, max_attempts=1)) as client:
        for _ in range(12):
            reset = await client.reset("notebook", split="test", index=1, timeout=60)
            step = asyncio.ensure_future(client.step(reset.episode_id, edit_cell("import time\ntime.sleep(2)"),
                                                     timeout=60))
            await asyncio.sleep(0.3)
            proxy.drop()
            with pytest.raises(Unavailable):
                await step
        assert (await client.close((await client.reset("notebook", split="test", index=1, timeout=60)).episode_id)).closed
        assert proxy.connections == 13

async def test_env_server_killed_mid_step_is_unavailable_and_a_restarted_one_serves_the_same_client() -> None:
    """A server that dies (SIGKILL) under a step on the shared stream: the step fails with
    UNAVAILABLE at once, as over unary calls, so the agent marks the replica down and starts the
    episode again elsewhere; the episode stays lost; the same client uses a restarted server."""
    port = free_port()
    args = [*NOTEBOOK_ARGS[:4], "--port", str(port), *NOTEBOOK_ARGS[6:]]
    server = start_server(args)
    try:
        async with EnvClient(ChannelConfig(target=server.target, max_attempts=1)) as client:
            reset = await client.reset("notebook", split="test", index=0, timeout=60)
            async def kill() -> None:
                server.kill()

            await fails_at_once_under_a_slow_step(client, reset.episode_id, kill)
            with pytest.raises(Unavailable) as lost:
                await client.verify(reset.episode_id, timeout=10)
            assert reset.episode_id in lost.value.message
            with pytest.raises(Unavailable):  # nothing listens: the new stream fails to open
                await client.reset("notebook", split="test", index=0, timeout=10)

            server = start_server(args)
            deadline = time.monotonic() + 60
            while True:  # the channel reconnects within its backoff
                try:
                    again = await client.reset("notebook", split="test", index=0, timeout=30)
                    break
                except Unavailable:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.5)
            step = await client.step(again.episode_id, edit_cell("print(2 + 3)"), timeout=60)
            assert step.step_count == 1 and any("5" in m.content for m in step.observations), step
            assert (await client.close(again.episode_id)).closed
    finally:
        server.stop()


# ---------------------------------------------------------------- (c) graceful shutdown


async def test_sigterm_lets_steps_in_flight_finish_refuses_new_resets_and_exits_0(
    notebook_server: ServerProcess,
) -> None:
    """Last in this file: it ends the shared notebook server."""
    server = notebook_server
    async with EnvClient(server.target) as client:
        episodes = [await client.reset("notebook", split="test", index=index) for index in range(2)]
        cell = edit_cell(f"import time\ntime.sleep({SLOW_CELL_S})\nprint('finished')")
        steps = [asyncio.ensure_future(client.step(e.episode_id, cell, request_id=new_request_id(), timeout=60))
                 for e in episodes]
        await asyncio.sleep(0.8)  # both steps are now running in their kernels
        assert not any(step.done() for step in steps)
        server.process.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)

        # A new client, without retries, is refused while the server drains.
        async with EnvClient(ChannelConfig(target=server.target, max_attempts=1)) as newcomer:
            with pytest.raises(Unavailable):
                await newcomer.reset("notebook", split="test", index=3, timeout=10)
        # The client's own Session stream runs on through the grace period, but opens no new episode.
        with pytest.raises(Unavailable) as draining:
            await client.reset("notebook", split="test", index=3, timeout=10)
        assert draining.value.reason == Reason.SHUTTING_DOWN, draining.value

        finished = await asyncio.gather(*steps)
    for step in finished:
        assert step.step_count == 1 and step.reward.status != INFRA_ERROR, step
        assert any("finished" in message.content for message in step.observations)
    assert server.process.wait(timeout=60) == 0, "\n".join(server.output)
