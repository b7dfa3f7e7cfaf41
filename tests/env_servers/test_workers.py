"""`sciproto serve env --workers N`: N server processes, one port each, episodes spread over them by
the client's replica pool and pinned to the worker that opened them; the workers end with the
group, however it ends."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter

import psutil
import pytest

from sciproto.client.env import EnvClient
from sciproto.client.replicas import ReplicaPool
from sciproto.pb import ENV_SERVICE, common_pb2
from sciproto.processes import ServerProcess, start_server

REPLY = common_pb2.ChatMessage(role=common_pb2.ROLE_ASSISTANT, content="42")


def start_group(workers: int) -> tuple[ServerProcess, list[str], list[psutil.Process]]:
    server = start_server(["serve", "env", "--env", "toy", "--port", "0", "--workers", str(workers)],
                          timeout_s=240)
    line = next(line for line in server.output if line.startswith("SCIPROTO_WORKERS "))
    targets = [f"127.0.0.1:{port}" for port in line.split("ports=")[1].split(",")]
    children = psutil.Process(server.process.pid).children()
    return server, targets, children


def wait_gone(processes: list[psutil.Process], timeout_s: float = 30.0) -> list[psutil.Process]:
    """The processes still running after `timeout_s`."""
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    return alive


async def test_each_worker_has_its_port_and_the_pool_spreads_and_pins_episodes() -> None:
    server, targets, children = start_group(2)
    try:
        assert len(set(targets)) == 2 and len(children) == 2
        async with ReplicaPool(targets, EnvClient, ENV_SERVICE) as pool:
            async def episode(index: int) -> str:
                async with pool.lease() as replica:
                    reset = await replica.client.reset("toy", split="train", index=index)
                    await asyncio.sleep(0.05)  # hold the lease, as a running episode does
                    step = await replica.client.step(reset.episode_id, REPLY)
                    assert step.terminated
                    assert (await replica.client.close(reset.episode_id)).closed
                    return replica.target

            used = Counter(await asyncio.gather(*(episode(i) for i in range(8))))
            assert used == {targets[0]: 4, targets[1]: 4}
            # Each worker holds its own episodes: the other one has never heard of them.
            async with EnvClient(targets[0]) as first, EnvClient(targets[1]) as second:
                reset = await first.reset("toy", split="train", index=0)
                assert not (await second.close(reset.episode_id)).closed
                assert (await first.close(reset.episode_id)).closed
                opened = [(await client.describe()).counters.episodes_opened for client in (first, second)]
            assert opened == [5, 4]
    finally:
        server.stop()
    assert server.process.returncode == 0
    assert wait_gone(children) == []


def test_workers_end_when_the_group_is_killed() -> None:
    server, _, children = start_group(2)
    try:
        os.kill(server.process.pid, signal.SIGKILL)
        assert wait_gone(children) == [], "a worker outlived the killed group process"
    finally:
        server.kill()
        for child in children:
            if child.is_running():
                child.kill()


def test_a_worker_that_dies_ends_the_group_with_a_failure() -> None:
    server, _, children = start_group(2)
    try:
        children[0].kill()
        deadline = time.monotonic() + 30
        while server.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not server.alive(), "the group kept running without one of its workers"
        assert server.process.returncode != 0
        assert wait_gone(children[1:]) == []
        assert any("exited with -9; stopping the others" in line for line in server.output)
    finally:
        server.kill()
        for child in children:
            if child.is_running():
                child.kill()


@pytest.mark.parametrize("workers", ["0", "-1"])
def test_workers_below_one_are_refused(workers: str) -> None:
    import subprocess

    from sciproto.processes import sciproto_command

    result = subprocess.run(sciproto_command("serve", "env", "--workers", workers), capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode != 0
    assert "--workers" in result.stderr
