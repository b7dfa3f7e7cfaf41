"""Step latency and throughput of the GSM8K calculator environment, four ways, in one run:

  in_process   Aviary's `env.step` called directly (the floor: no transport at all)
  unary        our EnvironmentService.Step, one call per step
  session      our EnvironmentService.Session, every episode multiplexed on one stream
  aviary_http  Aviary's own TaskDatasetServer (FastAPI over HTTP/1.1), persistent httpx client

and, for scale, the bare transport: a Session stream to a server that answers every step at once
with no environment (`transport_echo`, one episode only).

For each, at 1, 64 and 256 concurrent episodes: median and p99 step latency and steps/s. Every
step is a calculator call, which never ends the episode. Servers run as child processes on
loopback; the clients run here. Prints JSON with the ratios

  session p50 / in_process p50          (at 1 episode; goal <= 1.5)
  our steps/s / aviary_http steps/s     (at 256 episodes; goal >= 3)

    python bench/env_step.py [--seconds 2] [--concurrency 1,64,256]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before anything imports aviary
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

EXPRESSION = "12 * 34 + 5"
TASKS = 60  # size of the gsm8k test split; episode i runs task i % TASKS

Step = Callable[[], Awaitable[Any]]


def progress(message: str) -> None:
    print(f"[env_step] {message}", file=sys.stderr, flush=True)


@dataclass
class Figures:
    p50_us: float
    p99_us: float
    steps_per_s: float
    steps: int

    @classmethod
    def of(cls, latencies_s: list[float], elapsed_s: float) -> Figures:
        ordered = sorted(latencies_s)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        return cls(round(statistics.median(ordered) * 1e6, 1), round(p99 * 1e6, 1),
                   round(len(ordered) / elapsed_s, 1), len(ordered))


async def measure(steps: list[Step], seconds: float, warmup_steps: int = 3) -> Figures:
    """Run every episode's step in a loop, all at once, for `seconds`; latency of each step."""
    for _ in range(warmup_steps):
        await asyncio.gather(*(step() for step in steps))
    latencies: list[float] = []
    stop_at = time.perf_counter() + seconds

    async def loop(step: Step) -> None:
        while (start := time.perf_counter()) < stop_at:
            await step()
            latencies.append(time.perf_counter() - start)

    started = time.perf_counter()
    await asyncio.gather(*(loop(step) for step in steps))
    return Figures.of(latencies, time.perf_counter() - started)


# ---------------------------------------------------------------- the four ways


class InProcess:
    name = "in_process"

    def __init__(self) -> None:
        from aviary.core import ToolCall, ToolRequestMessage

        from env_servers.catalog import load_source

        self.source = load_source("gsm8k")
        self.action = ToolRequestMessage(tool_calls=[ToolCall.from_name("calculator", expr=EXPRESSION)])
        self.envs: list[Any] = []

    async def open(self, count: int) -> list[Step]:
        self.envs = [await self.source.make("test", i % TASKS) for i in range(count)]
        await asyncio.gather(*(env.reset() for env in self.envs))
        return [lambda env=env: env.step(self.action) for env in self.envs]

    async def close(self) -> None:
        await asyncio.gather(*(env.close() for env in self.envs))


class OurUnary:
    name = "unary"

    def __init__(self, target: str) -> None:
        from clients.env_client import EnvClient, tool_calls_action

        self.client = EnvClient(target)
        self.action = tool_calls_action(("calculator", {"expr": EXPRESSION}))
        self.episodes: list[str] = []

    async def open(self, count: int) -> list[Step]:
        resets = await asyncio.gather(*(self.client.reset("gsm8k", split="test", index=i % TASKS)
                                        for i in range(count)))
        self.episodes = [reset.episode_id for reset in resets]
        return [lambda e=episode: self.client.step(e, self.action) for episode in self.episodes]

    async def close(self) -> None:
        await asyncio.gather(*(self.client.close(episode) for episode in self.episodes))


class OurSession:
    name = "session"

    def __init__(self, target: str) -> None:
        from clients.env_client import EnvClient, tool_calls_action

        self.client = EnvClient(target)
        self.action = tool_calls_action(("calculator", {"expr": EXPRESSION}))
        self.stream: Any = None

    async def open(self, count: int) -> list[Step]:
        self.stream = self.client.session()
        session = await self.stream.__aenter__()
        resets = await asyncio.gather(*(session.reset("gsm8k", split="test", index=i % TASKS)
                                        for i in range(count)))
        return [lambda e=reset.episode_id: session.step(e, self.action) for reset in resets]

    async def close(self) -> None:
        await self.stream.__aexit__(None, None, None)  # the stream's end closes its episodes


class AviaryHttp:
    name = "aviary_http"

    def __init__(self, base_url: str) -> None:
        import httpx
        from aviary.core import ToolCall, ToolRequestMessage

        self.http = httpx.AsyncClient(base_url=base_url, timeout=60.0,
                                      limits=httpx.Limits(max_connections=1024, max_keepalive_connections=1024))
        action = ToolRequestMessage(tool_calls=[ToolCall.from_name("calculator", expr=EXPRESSION)])
        self.action = action.model_dump(mode="json")
        self.episodes: list[str] = []

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        response = await self.http.post(path, json=body)
        response.raise_for_status()
        return response.json()

    async def _start(self, index: int) -> str:
        env_id = (await self._post("/start", {"task_idx": index % TASKS}))["env_id"]
        await self._post("/reset", {"env_id": env_id})
        return env_id

    async def open(self, count: int) -> list[Step]:
        self.episodes = list(await asyncio.gather(*(self._start(i) for i in range(count))))
        return [lambda e=env_id: self._post("/step", {"env_id": e, "action": self.action})
                for env_id in self.episodes]

    async def close(self) -> None:
        await asyncio.gather(*(self._post("/close", {"env_id": e}) for e in self.episodes))


class TransportEcho:
    """One Session stream to a server that answers each step with an empty StepResponse."""

    name = "transport_echo"

    def __init__(self, target: str) -> None:
        import grpc

        from clients.env_client import tool_calls_action
        from sciproto.pb import env_grpc, env_pb2

        self.channel = grpc.aio.insecure_channel(target)
        self.stub = env_grpc.EnvironmentServiceStub(self.channel)
        action = tool_calls_action(("calculator", {"expr": EXPRESSION}))
        self.request = env_pb2.SessionRequest(step=env_pb2.StepRequest(episode_id="echo", action=action))
        self.call: Any = None

    async def open(self, count: int) -> list[Step]:
        assert count == 1, "the echo stream answers one step at a time"
        self.call = self.stub.Session()

        async def step() -> Any:
            await self.call.write(self.request)
            return await self.call.read()

        return [step]

    async def close(self) -> None:
        self.call.cancel()
        await self.channel.close()


# ---------------------------------------------------------------- servers


def serve_transport_echo() -> None:
    """Child process: an EnvironmentService whose Session answers every step at once."""
    import grpc

    from sciproto.pb import env_grpc, env_pb2

    class Echo(env_grpc.EnvironmentServiceServicer):
        async def Session(self, requests: Any, context: Any) -> Any:
            async for request in requests:
                yield env_pb2.SessionResponse(request_id=request.step.request_id, step=env_pb2.StepResponse())

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

    server = TaskDatasetServer(GSM8kDataset("test", hf_source=str(DATA_DIR)), host="127.0.0.1", port=0)
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


async def run_all(seconds: float, concurrencies: list[int]) -> dict[str, Any]:
    from sciproto.processes import start_command, start_server

    progress("starting our env server and Aviary's TaskDatasetServer")
    ours = start_server(["serve", "env", "--env", "gsm8k", "--port", "0",
                         "--set", f"max_live_episodes={4 * max(concurrencies)}"])
    aviary = start_command([sys.executable, __file__, "--serve-aviary-http"])
    echo = start_command([sys.executable, __file__, "--serve-transport-echo"])
    try:
        transport = TransportEcho(echo.target)
        floor = await measure(await transport.open(1), seconds)
        await transport.close()
        progress(f"transport echo x1    p50 {floor.p50_us:9.1f} us  p99 {floor.p99_us:9.1f} us")
        ways = [InProcess(), OurUnary(ours.target), OurSession(ours.target),
                AviaryHttp(f"http://127.0.0.1:{aviary.port}")]
        results: dict[str, dict[str, Any]] = {way.name: {} for way in ways}
        for concurrency in concurrencies:
            for way in ways:
                steps = await way.open(concurrency)
                figures = await measure(steps, seconds)
                await way.close()
                results[way.name][str(concurrency)] = figures.__dict__
                progress(f"{way.name:>12} x{concurrency:<4} p50 {figures.p50_us:9.1f} us  p99 "
                         f"{figures.p99_us:9.1f} us  {figures.steps_per_s:9.1f} steps/s")
        await ways[1].client.aclose()
        await ways[2].client.aclose()
        await ways[3].http.aclose()
    finally:
        for server in (ours, aviary, echo):
            server.stop()
    results[transport.name] = {"1": floor.__dict__}
    return results


def report(results: dict[str, Any], seconds: float, concurrencies: list[int]) -> dict[str, Any]:
    low, high = str(min(concurrencies)), str(max(concurrencies))
    session_latency = results["session"][low]["p50_us"] / results["in_process"][low]["p50_us"]
    # The least a Session step can cost: the environment's own step plus the bare round trip.
    floor = (results["in_process"][low]["p50_us"] + results["transport_echo"]["1"]["p50_us"]) \
        / results["in_process"][low]["p50_us"]
    session_throughput = results["session"][high]["steps_per_s"] / results["aviary_http"][high]["steps_per_s"]
    unary_throughput = results["unary"][high]["steps_per_s"] / results["aviary_http"][high]["steps_per_s"]
    return {
        "benchmark": "env_step",
        "environment": f"gsm8k CalculatorEnv, calculator({EXPRESSION!r}) steps",
        "seconds_per_point": seconds,
        "cpus": os.cpu_count(),
        "results": results,
        "ratios": {
            f"session_p50_over_in_process_p50_at_{low}": round(session_latency, 3),
            f"transport_floor_of_that_ratio_at_{low}": round(floor, 3),
            f"session_steps_per_s_over_aviary_http_at_{high}": round(session_throughput, 3),
            f"unary_steps_per_s_over_aviary_http_at_{high}": round(unary_throughput, 3),
        },
        "goals_met": {
            "session_p50_within_1.5x_of_in_process": session_latency <= 1.5,
            "steps_per_s_at_least_3x_aviary_http": max(session_throughput, unary_throughput) >= 3.0,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=2.0, help="measured seconds per point")
    parser.add_argument("--concurrency", default="1,64,256", help="concurrent episodes, comma-separated")
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
    results = asyncio.run(run_all(args.seconds, concurrencies))
    print(json.dumps(report(results, args.seconds, concurrencies), indent=2))


if __name__ == "__main__":
    main()
