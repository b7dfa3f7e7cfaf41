"""GSM8K episodes (reset, calculator step, submit step, close) through every way of running them,
side by side in one run, each server in its own process:

  in_process     Aviary's CalculatorEnv stepped in this process: the floor with no transport,
                 on one core
  aviary_http    Aviary's own TaskDatasetServer (FastAPI/uvicorn, HTTP/1.1 + JSON), driven by its
                 fastest Python client: httpx with the aiohttp transport (httpx-aiohttp)
  session        sciproto `Session`: raw grpc.aio stubs, every episode multiplexed on one stream
  session_per_episode  sciproto `Session`: raw grpc.aio stubs, one stream per episode (the
                 other way EnvClient could use streams; measured to choose between them)
  unary          sciproto unary Reset/Step/Close: raw grpc.aio stubs, one call per operation
  env_client     sciproto `EnvClient` through a `ReplicaPool`, what `sciproto collect` uses:
                 its operations on one shared Session stream per replica
  env_client_unary  the same with EnvClient(transport="unary"): one unary call per operation
  transport_echo a bare grpc.aio Session that answers every step with an empty response (the
                 transport's floor: no environment, no checks)
  unary_echo     the same server's bare unary Step: the floor of one RPC per operation
  transport_echo_native, session_native, unary_native, session_native_N_workers
                 the same episodes from bench/native/env_load, a C++ client on one thread
                 polling a gRPC completion queue (built here with CMake on first use;
                 `--no-native` leaves these rows out). It spends 0.06-0.14 ms of CPU per step
                 where the Python clients spend 0.4-0.7, so on cores it shares with the server
                 these rows show the server's own latency and scaling

NeMo Gym's Aviary resources server is not run: every nemo-gym release on PyPI needs
Python >= 3.12 (this project supports 3.11).

For each, at 1, 64 and 256 concurrent episodes (50 GSM8K test problems, episode i on problem
i % 50): step p50/p99 (the two env steps of each episode), steps/s (env steps; an episode has
two, plus its reset and close), episodes/s, and server CPU per step: the server processes' own
CPU time (user + system, psutil) over the measured window divided by the steps in it. With
`--workers 1,2` the env_client row also runs against `sciproto serve env --workers 2`, its
episodes spread by the replica pool, for the scaling over cores.

Prints JSON (to stdout, and `--output`) with the ratios of the goals:

  session steps/s / aviary_http steps/s           at 64 and 256   (goal >= 3)
  session steps/s / in_process steps/s            at 64 and 256   (goal >= 1)
  session step p50 / in_process step p50          at 1            (goal <= 2, with the Python
                                                                   or the native client), and the echo's
  unary, env_client steps/s / session steps/s     at 64 and 256   (goal >= 0.85), and
  env_client_unary, session_per_episode / session  (for comparison)
  2 workers / 1 worker steps/s                    at 256          (goal >= 1.5, env_client or
                                                                   session_native)

With the native client, `session_native_cores_at_256` is the cores one worker and its client
use together, and `session_native_N_workers_over_1_bound_at_256` the most N workers could reach
on this machine's cores at the CPU per step (server and client) of the N-worker run itself.

and where unary's extra CPU per step goes (`unary_cost_at_N`): an episode is 4 unary calls for
2 steps where Session sends 4 stream messages, so grpc.aio's own price of a unary call over a
stream message (unary_echo - transport_echo, server and client CPU, both bare) is paid twice per
step; `rest` is what is left for sciproto's unary path, and `unary_over_session_bound` the ratio
unary would reach on these cores (CPU-bound: server and client share them) if that rest were 0.

Each point is measured in `--slices` slices with the systems taking turns, so that the load of
a shared machine falls on all of them alike.

    python bench/env_step.py [--seconds 3] [--slices 3] [--concurrency 1,64,256] [--workers 1,2]
                             [--repeat 1] [--output FILE] [--no-native]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import socket
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before anything imports aviary
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil

EXPRESSION = "12 * 34 + 5"
ANSWER = "413"
TASKS = 50  # episode i runs problem i % TASKS of the gsm8k test split
SPLIT = "test"


def progress(message: str) -> None:
    print(f"[env_step] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- measuring


@dataclass
class Window:
    """What the episode loops of one system recorded at one concurrency, over all its slices."""

    step_latencies_s: list[float] = field(default_factory=list)
    episodes: int = 0
    elapsed_s: float = 0.0
    server_cpu_s: float = 0.0
    client_cpu_s: float = 0.0

    def figures(self, has_server: bool) -> dict[str, Any]:
        ordered = sorted(self.step_latencies_s)
        steps = len(ordered)
        figures = {
            "step_p50_ms": round(statistics.median(ordered) * 1e3, 3),
            "step_p99_ms": round(ordered[min(steps - 1, int(0.99 * steps))] * 1e3, 3),
            "steps_per_s": round(steps / self.elapsed_s, 1),
            "episodes_per_s": round(self.episodes / self.elapsed_s, 1),
            "steps": steps,
            "client_cpu_ms_per_step": round(self.client_cpu_s / steps * 1e3, 3),
        }
        if has_server:
            figures["server_cpu_ms_per_step"] = round(self.server_cpu_s / steps * 1e3, 3)
            figures["server_cpu_cores"] = round(self.server_cpu_s / self.elapsed_s, 2)
        return figures


def cpu_seconds(processes: Sequence[psutil.Process]) -> float:
    """User + system CPU time of `processes` and all their children (worker processes)."""
    total = 0.0
    for process in processes:
        for each in [process, *process.children(recursive=True)]:
            try:
                times = each.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += times.user + times.system
    return total


async def measure(system: System, concurrency: int, seconds: float, window: Window) -> None:
    """Add to `window`: `concurrency` loops of whole episodes for `seconds` (one slice)."""
    cpu_before = cpu_seconds(system.servers)
    elapsed, client_cpu = await system.drive(concurrency, seconds, window)
    window.elapsed_s += elapsed
    window.server_cpu_s += cpu_seconds(system.servers) - cpu_before
    window.client_cpu_s += client_cpu


async def warm_up(system: System, concurrency: int) -> None:
    """One episode per loop, not measured (datasets load, connections open)."""
    await system.drive(concurrency, 0.0, Window(), episodes_per_loop=1)


class System:
    """One way of running episodes. `servers`: the processes whose CPU counts as the server's."""

    name: str
    servers: Sequence[psutil.Process] = ()

    async def start(self) -> None:
        pass

    async def episode(self, index: int, window: Window) -> None:
        raise NotImplementedError

    async def drive(self, concurrency: int, seconds: float, window: Window,
                    episodes_per_loop: int = 0) -> tuple[float, float]:
        """`concurrency` loops of episodes, none started after `seconds` nor past
        `episodes_per_loop` in a loop (0: no cap), recorded in `window`; the elapsed seconds and
        the client's CPU seconds."""
        stop_at = time.perf_counter() + seconds

        def more(count: int) -> bool:
            return count < episodes_per_loop if episodes_per_loop else time.perf_counter() < stop_at

        async def loop(worker: int) -> None:
            for count, index in enumerate(itertools.count(worker, concurrency)):
                if not more(count):
                    return
                await self.episode(index, window)

        own_before = time.process_time()
        started = time.perf_counter()
        await asyncio.gather(*(loop(worker) for worker in range(concurrency)))
        return time.perf_counter() - started, time.process_time() - own_before

    async def stop(self) -> None:
        pass


async def timed(window: Window, call: Awaitable[Any]) -> Any:
    start = time.perf_counter()
    result = await call
    window.step_latencies_s.append(time.perf_counter() - start)
    return result


# ---------------------------------------------------------------- the systems


class InProcess(System):
    """Aviary's GSM8kDataset and CalculatorEnv, as TaskDatasetServer hosts them, in this process."""

    name = "in_process"

    async def start(self) -> None:
        from aviary.core import ToolCall, ToolRequestMessage
        from aviary.envs.gsm8k import GSM8kDataset

        from env_servers.envs.gsm8k import DATA_DIR

        self.dataset = GSM8kDataset(SPLIT, hf_source=str(DATA_DIR))
        self.calculate = lambda: ToolRequestMessage(tool_calls=[ToolCall.from_name("calculator", expr=EXPRESSION)])
        self.submit = lambda: ToolRequestMessage(tool_calls=[ToolCall.from_name("submit_answer", answer=ANSWER)])

    async def episode(self, index: int, window: Window) -> None:
        env = self.dataset.get_new_env_by_idx(index % TASKS)
        await env.reset()
        await timed(window, env.step(self.calculate()))
        _, _, done, _ = await timed(window, env.step(self.submit()))
        assert done, "submit_answer ends a gsm8k episode"
        await env.close()
        window.episodes += 1


class AviaryHttp(System):
    """TaskDatasetServer over HTTP/1.1, one keep-alive connection per concurrent episode."""

    name = "aviary_http"

    def __init__(self, base_url: str, server: psutil.Process) -> None:
        self.base_url, self.servers = base_url, [server]

    async def start(self) -> None:
        import httpx
        from httpx_aiohttp import HttpxAiohttpClient

        self.http = HttpxAiohttpClient(base_url=self.base_url, timeout=60.0,
                                       limits=httpx.Limits(max_connections=1024, max_keepalive_connections=1024))
        calculate = {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_calc", "type": "function", "function": {"name": "calculator", "arguments": {"expr": EXPRESSION}}}]}
        submit = {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_submit", "type": "function", "function": {"name": "submit_answer", "arguments": {"answer": ANSWER}}}]}
        self.calculate, self.submit = calculate, submit

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        response = await self.http.post(path, json=body)
        response.raise_for_status()
        return response.json()

    async def episode(self, index: int, window: Window) -> None:
        env_id = (await self._post("/start", {"task_idx": index % TASKS}))["env_id"]
        await self._post("/reset", {"env_id": env_id})
        await timed(window, self._post("/step", {"env_id": env_id, "action": self.calculate}))
        _, _, done, _ = await timed(window, self._post("/step", {"env_id": env_id, "action": self.submit}))
        assert done, "submit_answer ends a gsm8k episode"
        await self._post("/close", {"env_id": env_id})
        window.episodes += 1

    async def stop(self) -> None:
        await self.http.aclose()


class _Requests:
    """The protobuf requests of one episode, built the way a client would (fresh ids)."""

    def __init__(self) -> None:
        from sciproto.client.env import tool_calls_action
        from sciproto.pb import env_pb2

        self.pb = env_pb2
        self.calculate = tool_calls_action(("calculator", {"expr": EXPRESSION}))
        self.submit = tool_calls_action(("submit_answer", {"answer": ANSWER}))
        self._prefix = uuid.uuid4().hex[:12]  # request ids are unique across clients of one server
        self._ids = itertools.count()

    def id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    def reset(self, index: int) -> Any:
        return self.pb.ResetRequest(request_id=self.id(), env="gsm8k",
                                    task_ref={"split": SPLIT, "index": index % TASKS})

    def step(self, episode_id: str, action: Any) -> Any:
        return self.pb.StepRequest(request_id=self.id(), episode_id=episode_id, action=action)

    def close(self, episode_id: str) -> Any:
        return self.pb.CloseRequest(request_id=self.id(), episode_id=episode_id)


class _RawStubs(System):
    """Raw grpc.aio stubs, one channel per server."""

    def __init__(self, targets: list[str], servers: list[psutil.Process]) -> None:
        self.targets, self.servers = targets, servers

    async def start(self) -> None:
        import grpc

        from sciproto.pb import env_grpc

        self.requests = _Requests()
        self.channels = [grpc.aio.insecure_channel(target) for target in self.targets]
        self.stubs = [env_grpc.EnvironmentServiceStub(channel) for channel in self.channels]

    async def stop(self) -> None:
        await asyncio.gather(*(channel.close() for channel in self.channels))


class Unary(_RawStubs):
    """Raw grpc.aio stubs: Reset, Step, Step, Close as unary calls on one channel."""

    name = "unary"

    async def episode(self, index: int, window: Window) -> None:
        stub, requests = self.stubs[index % len(self.stubs)], self.requests
        episode_id = (await stub.Reset(requests.reset(index))).episode_id
        await timed(window, stub.Step(requests.step(episode_id, requests.calculate)))
        step = await timed(window, stub.Step(requests.step(episode_id, requests.submit)))
        assert step.terminated, "submit_answer ends a gsm8k episode"
        await stub.Close(requests.close(episode_id))
        window.episodes += 1


class _Stream:
    """One raw Session stream: requests written one at a time, answers matched by request_id."""

    def __init__(self, stub: Any) -> None:
        self.call = stub.Session()
        self.waiting: dict[str, asyncio.Future[Any]] = {}
        self.writing = asyncio.Lock()  # grpc.aio allows one pending write per stream
        self.reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        async for answer in self.call:
            if answer.WhichOneof("result") == "heartbeat":
                continue
            future = self.waiting.pop(answer.request_id)
            if answer.WhichOneof("result") == "error":
                future.set_exception(RuntimeError(f"{answer.error.code}: {answer.error.message}"))
            else:
                future.set_result(answer)

    async def run(self, request: Any, request_id: str) -> Any:
        future = asyncio.get_running_loop().create_future()
        self.waiting[request_id] = future
        async with self.writing:
            await self.call.write(request)
        return await future

    async def close(self) -> None:
        await self.call.done_writing()
        await asyncio.wait_for(self.reader, 30)


async def _stream_episode(stream: _Stream, requests: _Requests, index: int, window: Window) -> None:
    """Reset, calculator step, submit step and Close of one episode, on `stream`."""
    pb = requests.pb
    reset = requests.reset(index)
    episode_id = (await stream.run(pb.SessionRequest(reset=reset), reset.request_id)).reset.episode_id
    for action in (requests.calculate, requests.submit):
        step = requests.step(episode_id, action)
        answer = await timed(window, stream.run(pb.SessionRequest(step=step), step.request_id))
    assert answer.step.terminated, "submit_answer ends a gsm8k episode"
    close = requests.close(episode_id)
    await stream.run(pb.SessionRequest(close=close), close.request_id)
    window.episodes += 1


class Session(_RawStubs):
    """Raw grpc.aio stubs, every episode on one Session stream (one stream per server)."""

    name = "session"

    async def start(self) -> None:
        await super().start()
        self.streams = [_Stream(stub) for stub in self.stubs]

    async def episode(self, index: int, window: Window) -> None:
        await _stream_episode(self.streams[index % len(self.streams)], self.requests, index, window)

    async def stop(self) -> None:
        await asyncio.gather(*(stream.close() for stream in self.streams))
        await super().stop()


class SessionPerEpisode(_RawStubs):
    """Raw grpc.aio stubs, each episode on a Session stream of its own."""

    name = "session_per_episode"

    async def episode(self, index: int, window: Window) -> None:
        stream = _Stream(self.stubs[index % len(self.stubs)])
        await _stream_episode(stream, self.requests, index, window)
        await stream.close()


class EnvClientPool(System):
    """`EnvClient` through a `ReplicaPool` (least-loaded replica per episode, the episode
    pinned to it), as the agent loop of `sciproto collect` makes its calls."""

    name = "env_client"

    def __init__(self, targets: list[str], servers: list[psutil.Process], name: str | None = None,
                 transport: str = "session") -> None:
        self.targets, self.servers, self.transport = targets, servers, transport
        self.name = name or self.name

    async def start(self) -> None:
        from sciproto.client.env import EnvClient, tool_calls_action
        from sciproto.client.replicas import ReplicaPool
        from sciproto.pb import ENV_SERVICE

        transport = self.transport
        self.pool = ReplicaPool(self.targets, lambda channel: EnvClient(channel, transport=transport), ENV_SERVICE,
                                bare_streams=True)  # as clients.agent.env_pool makes it
        self.calculate = tool_calls_action(("calculator", {"expr": EXPRESSION}))
        self.submit = tool_calls_action(("submit_answer", {"answer": ANSWER}))

    async def episode(self, index: int, window: Window) -> None:
        async with self.pool.lease() as replica:
            env = replica.client
            reset = await env.reset("gsm8k", split=SPLIT, index=index % TASKS)
            await timed(window, env.step(reset.episode_id, self.calculate))
            step = await timed(window, env.step(reset.episode_id, self.submit))
            assert step.terminated, "submit_answer ends a gsm8k episode"
            await env.close(reset.episode_id)
        window.episodes += 1

    async def stop(self) -> None:
        await self.pool.aclose()


class TransportEcho(System):
    """A Session stream to a server that answers each step at once, with no environment."""

    name = "transport_echo"

    def __init__(self, target: str, server: psutil.Process) -> None:
        self.target, self.servers = target, [server]

    async def start(self) -> None:
        import grpc

        from sciproto.pb import env_grpc

        self.requests = _Requests()
        self.channel = grpc.aio.insecure_channel(self.target)
        self.stream = _Stream(env_grpc.EnvironmentServiceStub(self.channel))

    async def episode(self, index: int, window: Window) -> None:
        pb = self.requests.pb
        for action in (self.requests.calculate, self.requests.submit):
            step = self.requests.step("echo", action)
            await timed(window, self.stream.run(pb.SessionRequest(step=step), step.request_id))
        window.episodes += 1

    async def stop(self) -> None:
        await self.stream.close()
        await self.channel.close()


class UnaryEcho(System):
    """Unary Step calls to the echo server: the floor of one RPC per operation."""

    name = "unary_echo"

    def __init__(self, target: str, server: psutil.Process) -> None:
        self.target, self.servers = target, [server]

    async def start(self) -> None:
        import grpc

        from sciproto.pb import env_grpc

        self.requests = _Requests()
        self.channel = grpc.aio.insecure_channel(self.target)
        self.stub = env_grpc.EnvironmentServiceStub(self.channel)

    async def episode(self, index: int, window: Window) -> None:
        for action in (self.requests.calculate, self.requests.submit):
            await timed(window, self.stub.Step(self.requests.step("echo", action)))
        window.episodes += 1

    async def stop(self) -> None:
        await self.channel.close()


class Native(System):
    """bench/native/env_load (C++, one thread on a gRPC completion queue) driving `mode` against
    `targets`, commanded over its stdin (it exits when that closes): the server measured by a
    client whose own CPU and thread hops are small beside the server's."""

    def __init__(self, name: str, mode: str, targets: list[str], servers: list[psutil.Process]) -> None:
        self.name, self.mode, self.targets, self.servers = name, mode, targets, servers

    async def start(self) -> None:
        self.process = await asyncio.create_subprocess_exec(
            str(NATIVE_BINARY), self.mode, ",".join(self.targets), "--split", SPLIT, "--tasks", str(TASKS),
            "--expr", EXPRESSION, "--answer", ANSWER, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            limit=2**28)  # one answer line carries every step latency of a window

    async def drive(self, concurrency: int, seconds: float, window: Window,
                    episodes_per_loop: int = 0) -> tuple[float, float]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(f"run {concurrency} {seconds} {episodes_per_loop}\n".encode())
        await self.process.stdin.drain()
        line = await asyncio.wait_for(self.process.stdout.readline(), timeout=seconds + 120)
        if not line:
            raise RuntimeError(f"{self.name}: env_load exited with {await self.process.wait()}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"{self.name}: {answer['error']}")
        window.step_latencies_s.extend(ns / 1e9 for ns in answer["latencies_ns"])
        window.episodes += answer["episodes"]
        return answer["elapsed_s"], answer["cpu_s"]

    async def stop(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(b"quit\n")
        self.process.stdin.close()
        try:
            await asyncio.wait_for(self.process.wait(), timeout=60)
        except TimeoutError:
            self.process.kill()
            await self.process.wait()


NATIVE_DIR = Path(__file__).resolve().parent / "native"
NATIVE_BINARY = NATIVE_DIR / "build" / "env_load"


def build_native() -> str | None:
    """Builds bench/native/env_load if it is missing or older than its sources (CMake, a C++
    compiler, protoc, grpc_cpp_plugin, and grpc++ and protobuf found by pkg-config); None when
    it is ready, else why not."""
    import shutil
    import subprocess

    root = NATIVE_DIR.parents[1]
    sources = [*NATIVE_DIR.glob("*.cc"), NATIVE_DIR / "CMakeLists.txt", *(root / "clients" / "cpp").glob("*.*"),
               *(root / "proto").rglob("*.proto")]
    newest = max(path.stat().st_mtime for path in sources if path.is_file())
    if NATIVE_BINARY.exists() and NATIVE_BINARY.stat().st_mtime >= newest:
        return None
    missing = [tool for tool in ("cmake", "c++", "protoc", "grpc_cpp_plugin", "pkg-config") if not shutil.which(tool)]
    if missing:
        return (f"the native client needs {', '.join(missing)} (Debian: libgrpc++-dev protobuf-compiler-grpc "
                "protobuf-compiler libprotobuf-dev cmake g++ pkg-config)")
    progress("building the native client (bench/native, about a minute)")
    build = NATIVE_DIR / "build"
    for command in (["cmake", "-S", str(NATIVE_DIR), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release"],
                    ["cmake", "--build", str(build), "-j", str(os.cpu_count() or 1), "--target", "env_load"]):
        done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
        if done.returncode != 0:
            tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
            return f"building the native client failed ({' '.join(command[:2])}): " + " / ".join(tail)
    return None


# ---------------------------------------------------------------- servers


def serve_transport_echo() -> None:
    """Child process: an EnvironmentService whose Session answers every step at once."""
    import grpc

    from sciproto.pb import env_grpc, env_pb2

    class Echo(env_grpc.EnvironmentServiceServicer):
        async def Session(self, requests: Any, context: Any) -> Any:
            async for request in requests:
                yield env_pb2.SessionResponse(request_id=request.step.request_id, step=env_pb2.StepResponse())

        async def Step(self, request: Any, context: Any) -> Any:
            return env_pb2.StepResponse()

    async def run() -> None:
        server = grpc.aio.server()
        env_grpc.add_EnvironmentServiceServicer_to_server(Echo(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(f"SCIPROTO_READY echo port={port}", flush=True)
        await server.wait_for_termination()

    asyncio.run(run())


def serve_aviary_http() -> None:
    """Child process: Aviary's TaskDatasetServer over the same GSM8K test split, on loopback.
    Logging is kept at warnings (Aviary's own start() logs every request at debug level,
    which would slow it down for reasons that are not its transport)."""
    import uvicorn
    from aviary.dataset_server import TaskDatasetServer
    from aviary.envs.gsm8k import GSM8kDataset

    from env_servers.envs.gsm8k import DATA_DIR

    server = TaskDatasetServer(GSM8kDataset(SPLIT, hf_source=str(DATA_DIR)), host="127.0.0.1", port=0)
    # proto=IPPROTO_TCP: asyncio turns Nagle off only on sockets that say they are TCP; without it
    # every keep-alive response would wait ~40 ms for a delayed ACK.
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    listener.bind(("127.0.0.1", 0))
    uvicorn_server = uvicorn.Server(uvicorn.Config(server.app, log_level="warning", access_log=False))

    async def run() -> None:
        serving = asyncio.ensure_future(uvicorn_server.serve(sockets=[listener]))
        while not uvicorn_server.started:
            await asyncio.sleep(0.05)
        print(f"SCIPROTO_READY aviary port={listener.getsockname()[1]}", flush=True)
        await serving

    asyncio.run(run())


def worker_targets(server: Any) -> list[str]:
    """The ports of every worker of `sciproto serve env --workers N` (its SCIPROTO_WORKERS line),
    or the one port of a single server."""
    for line in list(server.output):
        if line.startswith("SCIPROTO_WORKERS "):
            ports = line.split("ports=")[1].split(",")
            return [f"127.0.0.1:{port}" for port in ports]
    return [server.target]


# ---------------------------------------------------------------- the run


async def run_all(seconds: float, concurrencies: list[int], workers: list[int], slices: int,
                  only: set[str] | None = None, native: bool = True) -> dict[str, Any]:
    from sciproto.processes import start_command, start_server

    cap = f"max_live_episodes={4 * max(concurrencies)}"
    progress("starting our env server, Aviary's TaskDatasetServer and the echo server")
    ours = start_server(["serve", "env", "--env", "gsm8k", "--port", "0", "--set", cap])
    aviary = start_command([sys.executable, __file__, "--serve-aviary-http"])
    echo = start_command([sys.executable, __file__, "--serve-transport-echo"])
    scaled = {n: start_server(["serve", "env", "--env", "gsm8k", "--port", "0", "--workers", str(n), "--set", cap])
              for n in workers if n > 1}
    try:
        server = [psutil.Process(ours.process.pid)]
        systems: list[System] = [
            TransportEcho(echo.target, psutil.Process(echo.process.pid)),
            UnaryEcho(echo.target, psutil.Process(echo.process.pid)),
            InProcess(),
            AviaryHttp(f"http://127.0.0.1:{aviary.port}", psutil.Process(aviary.process.pid)),
            Session([ours.target], server),
            SessionPerEpisode([ours.target], server),
            Unary([ours.target], server),
            EnvClientPool([ours.target], server),
            EnvClientPool([ours.target], server, name="env_client_unary", transport="unary"),
            *(EnvClientPool(worker_targets(process), [psutil.Process(process.process.pid)],
                            name=f"env_client_{n}_workers") for n, process in scaled.items()),
        ]
        if native:
            systems += [
                Native("transport_echo_native", "session_echo", [echo.target], [psutil.Process(echo.process.pid)]),
                Native("session_native", "session", [ours.target], server),
                Native("unary_native", "unary", [ours.target], server),
                *(Native(f"session_native_{n}_workers", "session", worker_targets(process),
                         [psutil.Process(process.process.pid)]) for n, process in scaled.items()),
            ]
        if only:
            systems = [system for system in systems if system.name in only]
        progress(f"server pids: ours {ours.process.pid}, aviary {aviary.process.pid}, echo {echo.process.pid}")
        results: dict[str, dict[str, Any]] = {system.name: {} for system in systems}
        for system in systems:
            await system.start()
        for concurrency in concurrencies:
            here = [system for system in systems
                    if not system.name.endswith("_workers") or concurrency == max(concurrencies)]
            windows = {system.name: Window() for system in here}
            for system in here:
                await warm_up(system, concurrency)
            # Slices taken in turn: a change in the machine's load (it is shared) falls on every
            # system alike instead of on whichever was measured at that moment.
            for _ in range(slices):
                for system in here:
                    await measure(system, concurrency, seconds / slices, windows[system.name])
            for system in here:
                figures = windows[system.name].figures(bool(system.servers))
                results[system.name][str(concurrency)] = figures
                cpu = figures.get("server_cpu_ms_per_step")
                progress(f"{system.name:>20} x{concurrency:<4} p50 {figures['step_p50_ms']:8.3f} ms  "
                         f"{figures['steps_per_s']:8.1f} steps/s  server CPU "
                         f"{f'{cpu:.3f} ms/step' if cpu is not None else '-'}")
        for system in systems:
            await system.stop()
    finally:
        for process in (ours, aviary, echo, *scaled.values()):
            process.stop()
    return results


def ratios(results: dict[str, Any], concurrencies: list[int], workers: list[int]) -> dict[str, float]:
    def rate(system: str, at: int) -> float:
        return results[system][str(at)]["steps_per_s"]

    low = min(concurrencies)
    out: dict[str, float] = {
        f"session_p50_over_in_process_p50_at_{low}":
            results["session"][str(low)]["step_p50_ms"] / results["in_process"][str(low)]["step_p50_ms"],
        f"env_client_p50_over_in_process_p50_at_{low}":
            results["env_client"][str(low)]["step_p50_ms"] / results["in_process"][str(low)]["step_p50_ms"],
        f"echo_p50_over_in_process_p50_at_{low}":
            results["transport_echo"][str(low)]["step_p50_ms"] / results["in_process"][str(low)]["step_p50_ms"],
    }
    for at in concurrencies:
        if at == low:
            continue
        out[f"session_over_aviary_http_at_{at}"] = rate("session", at) / rate("aviary_http", at)
        out[f"session_over_in_process_at_{at}"] = rate("session", at) / rate("in_process", at)
        out[f"unary_over_session_at_{at}"] = rate("unary", at) / rate("session", at)
        out[f"env_client_over_session_at_{at}"] = rate("env_client", at) / rate("session", at)
        out[f"env_client_unary_over_session_at_{at}"] = rate("env_client_unary", at) / rate("session", at)
        out[f"session_per_episode_over_session_at_{at}"] = rate("session_per_episode", at) / rate("session", at)
        out[f"aviary_http_server_cpu_over_session_at_{at}"] = (
            results["aviary_http"][str(at)]["server_cpu_ms_per_step"]
            / results["session"][str(at)]["server_cpu_ms_per_step"])
        out.update({f"unary_{key}_at_{at}": value for key, value in unary_cost(results, at).items()})
    high = max(concurrencies)
    for n in workers:
        if n > 1:
            out[f"env_client_{n}_workers_over_1_at_{high}"] = rate(f"env_client_{n}_workers", high) / rate("env_client", high)
    if "session_native" in results:
        out.update(native_ratios(results, concurrencies, workers))
    return {key: round(value, 3) for key, value in out.items()}


def native_ratios(results: dict[str, Any], concurrencies: list[int], workers: list[int]) -> dict[str, float]:
    """The rows of the native client: latency at one episode, unary against Session on the
    server alone, and the scaling over worker processes; with the cores the server processes
    used, which bound that scaling on this machine."""
    def row(system: str, at: int) -> dict[str, Any]:
        return results[system][str(at)]

    low, high = min(concurrencies), max(concurrencies)
    in_process_p50 = row("in_process", low)["step_p50_ms"]
    out = {f"session_native_p50_over_in_process_p50_at_{low}": row("session_native", low)["step_p50_ms"] / in_process_p50,
           f"echo_native_p50_over_in_process_p50_at_{low}":
               row("transport_echo_native", low)["step_p50_ms"] / in_process_p50}
    for at in concurrencies:
        if at != low:
            out[f"unary_native_over_session_native_at_{at}"] = (row("unary_native", at)["steps_per_s"]
                                                                / row("session_native", at)["steps_per_s"])
    single = row("session_native", high)
    out[f"session_native_cores_at_{high}"] = single["server_cpu_cores"] + single["client_cpu_ms_per_step"] * single["steps_per_s"] / 1e3
    for n in workers:
        if n > 1:
            out[f"session_native_{n}_workers_over_1_at_{high}"] = (row(f"session_native_{n}_workers", high)["steps_per_s"]
                                                                  / single["steps_per_s"])
            # The most n workers can reach on these cores, at the CPU per step (server and
            # client) of the n-worker run itself.
            scaled = row(f"session_native_{n}_workers", high)
            cpu_per_step_s = (scaled["server_cpu_ms_per_step"] + scaled["client_cpu_ms_per_step"]) / 1e3
            out[f"session_native_{n}_workers_over_1_bound_at_{high}"] = (
                min(n, os.cpu_count() or 1) / cpu_per_step_s / single["steps_per_s"])
    return out


UNARY_CALLS_PER_STEP = 2  # reset, step, step, close: 4 calls (or stream messages) per 2 steps


def unary_cost(results: dict[str, Any], at: int) -> dict[str, float]:
    """Unary's extra CPU per step over Session, split into grpc.aio's price of a unary call over a
    stream message (the bare echos) and the rest; and the unary/Session ratio that price alone allows."""
    def cpu(system: str, side: str) -> float:
        return results[system][str(at)][f"{side}_cpu_ms_per_step"]

    excess = sum(cpu("unary", side) - cpu("session", side) for side in ("server", "client"))
    transport = UNARY_CALLS_PER_STEP * sum(cpu("unary_echo", side) - cpu("transport_echo", side)
                                           for side in ("server", "client"))
    session = cpu("session", "server") + cpu("session", "client")
    return {"excess_cpu_ms_per_step": excess, "grpc_call_over_message_cpu_ms_per_step": transport,
            "rest_cpu_ms_per_step": excess - transport,
            "over_session_bound": session / (session + transport)}


def goals(ratio: dict[str, float], concurrencies: list[int], workers: list[int]) -> dict[str, bool]:
    low, high = min(concurrencies), max(concurrencies)
    many = [at for at in concurrencies if at != low]
    met = {
        "session_at_least_3x_aviary_http": all(ratio[f"session_over_aviary_http_at_{at}"] >= 3 for at in many),
        "session_at_least_in_process": all(ratio[f"session_over_in_process_at_{at}"] >= 1 for at in many),
        "session_p50_within_2x_in_process": ratio[f"session_p50_over_in_process_p50_at_{low}"] <= 2,
        "unary_and_env_client_within_15pct_of_session": all(
            ratio[f"{way}_over_session_at_{at}"] >= 0.85 for way in ("unary", "env_client") for at in many),
    }
    native = f"session_native_p50_over_in_process_p50_at_{low}" in ratio
    if native:  # with the best client each side has: the server's latency, not the client's
        met["session_p50_within_2x_in_process"] = min(
            ratio[f"session_p50_over_in_process_p50_at_{low}"], ratio[f"session_native_p50_over_in_process_p50_at_{low}"]) <= 2
    for n in workers:
        if n > 1:
            best = ratio[f"env_client_{n}_workers_over_1_at_{high}"]
            if native:
                best = max(best, ratio[f"session_native_{n}_workers_over_1_at_{high}"])
            met[f"{n}_workers_at_least_1.5x"] = best >= 1.5
    return met


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0, help="measured seconds per point")
    parser.add_argument("--concurrency", default="1,64,256", help="concurrent episodes, comma-separated")
    parser.add_argument("--workers", default="1", help="worker counts for the scaling row, e.g. 1,2")
    parser.add_argument("--repeat", type=int, default=1, help="run everything this many times")
    parser.add_argument("--slices", type=int, default=3,
                        help="each point is measured in this many slices, the systems taking turns")
    parser.add_argument("--output", type=Path, help="also write the JSON report here")
    parser.add_argument("--systems", help="only these rows, comma-separated (no ratios): for profiling")
    parser.add_argument("--no-native", action="store_true",
                        help="leave out the rows of the native (C++) client, which needs a C++ toolchain and grpc++")
    parser.add_argument("--serve-aviary-http", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve-transport-echo", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_aviary_http:
        serve_aviary_http()
        return
    if args.serve_transport_echo:
        serve_transport_echo()
        return
    concurrencies = sorted(int(c) for c in args.concurrency.split(","))
    workers = sorted(int(n) for n in args.workers.split(","))
    not_run = {"nemo_gym": "every nemo-gym release on PyPI needs Python >= 3.12; this runs on "
                           f"{sys.version_info.major}.{sys.version_info.minor}"}
    native = not args.no_native
    if native and (why := build_native()) is not None:
        not_run["native_client"] = why
        native = False
        progress(f"not running the native client's rows: {why}")
    if args.systems:
        only = set(args.systems.split(","))
        print(json.dumps(asyncio.run(run_all(args.seconds, concurrencies, workers, args.slices, only, native)), indent=2))
        return
    runs = []
    for repeat in range(args.repeat):
        progress(f"run {repeat + 1} of {args.repeat}")
        results = asyncio.run(run_all(args.seconds, concurrencies, workers, args.slices, native=native))
        ratio = ratios(results, concurrencies, workers)
        runs.append({"results": results, "ratios": ratio, "goals_met": goals(ratio, concurrencies, workers)})
    report = {
        "benchmark": "env_step",
        "episode": f"gsm8k test problem i % {TASKS}: reset, calculator({EXPRESSION!r}), submit_answer, close",
        "seconds_per_point": args.seconds,
        "slices_per_point": args.slices,
        "cpus": os.cpu_count(),
        "not_run": not_run,
        "runs": runs,
    }
    if len(runs) > 1:
        report["ratio_spread"] = {key: [min(r["ratios"][key] for r in runs), max(r["ratios"][key] for r in runs)]
                                  for key in runs[0]["ratios"]}
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
