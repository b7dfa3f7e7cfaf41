"""The Ray engine on a real (simulated) Ray cluster: `ray.cluster_utils.Cluster` runs a head with no
CPUs and three nodes, each a real raylet with its own resources (one declares a logical GPU), so
every server is a real actor process on the node its role asked for. One cluster for the module,
small object stores; every Ray process is gone when the module ends."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import LOOPBACK_ONLY

# Local nodes on loopback. In the loopback-only network namespace of scripts/test.sh Ray finds
# 127.0.0.1 by itself; elsewhere (pytest run by hand) Ray's single-machine mode gives it (set before
# Ray is imported, which reads it then). Never for a real cluster.
if not LOOPBACK_ONLY:
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

ray = pytest.importorskip("ray", reason="the Ray engine's tests need the sciproto[ray] extra")

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.train import load_train_config, train
from clients.train.cluster import ClusterSettings, LearnerResources, RoleResources
from clients.train.ray_engine import RayEngine, RayServers, actor_state
from clients.train.resume import latest_checkpoint, trained_steps
from sciproto import cli_errors, pb
from sciproto.channel import make_channel
from sciproto.client.env import EnvClient
from sciproto.client.policy import PolicyClient
from sciproto.pb import common_pb2, learner_grpc, learner_pb2

pytestmark = pytest.mark.timeout(600)

STORE = 80 * 2**20  # bytes of object store per node (Ray's floor is about 75 MiB)

# Where each role may run: env servers on the rollout node(s), the policy on the GPU node, the
# learner on the trainer node (custom resources pin them; the GPU is a logical one).
PLACEMENT = ClusterSettings(
    engine="ray",
    env=RoleResources(cpus=1, resources={"rollout": 1}),
    policy=RoleResources(cpus=1, gpus=1),
    learner=LearnerResources(cpus=1, resources={"trainer": 1}),
    start_timeout_s=240,
    stop_timeout_s=60,
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Any, dict[str, Any]]]:
    from ray.cluster_utils import Cluster

    # The GCS declares a killed node dead after 5 failed health checks: 1 s apart here (Ray's
    # default is 3 s), so each node-loss test waits about 8 s for it here, not 16.
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "object_store_memory": STORE, "_system_config": {"health_check_period_ms": 1000}})
    try:
        nodes = {
            "rollout": cluster.add_node(num_cpus=1, resources={"rollout": 1}, object_store_memory=STORE),
            "gpu": cluster.add_node(num_cpus=1, num_gpus=1, object_store_memory=STORE),
            "trainer": cluster.add_node(num_cpus=1, resources={"trainer": 1}, object_store_memory=STORE),
        }
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


def demo_config(tmp_path: Path, *overrides: str) -> Any:
    return load_train_config("demo", [f"run.dir={tmp_path}", "progress=false", *overrides])


async def serving(target: str, service: str) -> bool:
    async with make_channel(target) as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=10)
    return response.status == health_pb2.HealthCheckResponse.SERVING


async def serves_real_clients(servers: Any) -> None:
    """Each server listens on its node's IP (never localhost) and answers a real client."""
    targets = {role: servers.targets(role) for role in ("env", "policy", "learner")}
    for role, (target,) in targets.items():
        host, port = target.rsplit(":", 1)
        assert host == ray.util.get_node_ip_address() and int(port) > 0, (role, target)
        assert host != "localhost"
    async with EnvClient(targets["env"][0]) as env:
        reset = await env.reset("toy", split="train", index=0, timeout=30)
        assert reset.episode_id and (await env.close(reset.episode_id)).closed
    policy = PolicyClient(targets["policy"][0])
    try:
        assert (await policy.describe(timeout_s=30)).model
    finally:
        await policy.close()
    assert await serving(targets["learner"][0], pb.LEARNER_SERVICE)
    assert servers.failure() is None


class PlacedEngine(RayEngine):
    """The Ray engine, remembering where each role's servers started; with `check_clients`,
    real clients call each server before the run starts."""

    metrics: Path | None = None

    def __init__(self, settings: ClusterSettings, check_clients: bool = False) -> None:
        super().__init__(settings)
        self.check_clients = check_clients

    def start(self, config: Any, run_dir: Path) -> Any:
        self.metrics = run_dir / "metrics.jsonl"
        self.servers = super().start(config, run_dir)
        self.placed = {role: self.servers.node_ids(role) for role in ("env", "policy", "learner")}
        if self.check_clients:
            asyncio.run(serves_real_clients(self.servers))
        return self.servers


SCIPROTO = Path(sys.executable).parent / "sciproto"


def session_processes(session: int) -> set[int]:
    """Live processes of `session` (`sciproto train` started in a session of its own), and their
    descendants: the local Ray a run starts and every actor of it."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, ValueError):
            continue
        if fields[0] != "Z":
            table[int(stat.parent.name)] = (int(fields[1]), int(fields[3]))
    found = {pid for pid, (_, sid) in table.items() if sid == session}
    while more := {pid for pid, (ppid, _) in table.items() if ppid in found} - found:
        found |= more
    return found


def train_as_typed(run_dir: Path, *extra: str, timeout_s: float = 540) -> tuple[subprocess.CompletedProcess[str], set[int]]:
    """`sciproto train --config demo --cluster ray` as a user types it (no Ray address, no Ray
    settings in the environment), a step budget of 2: what it printed, and what of its process
    session is still alive 20 s after it exited."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    process = subprocess.Popen(
        [str(SCIPROTO), "train", "--config", "demo", "--cluster", "ray", "--set", f"run.dir={run_dir}",
         "--set", "budget.max_steps=2", "--set", "progress=false", *extra],
        env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout_s)
    finally:
        deadline = time.monotonic() + 20
        while session_processes(process.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = session_processes(process.pid)
        for pid in left:
            os.kill(pid, 9)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err), left


def test_the_demo_command_as_typed_trains_on_a_local_ray_sized_for_its_servers(tmp_path: Path) -> None:
    """A local Ray gets a logical CPU for each server the demo places (3 on this 2-core machine),
    so the command trains with no cluster settings, and nothing of its Ray outlives it."""
    # A bounded wait, so that a Ray too small for the servers fails here in minutes, not 5.
    result, left = train_as_typed(tmp_path, "--set", "cluster.start_timeout_s=120")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [step["step"] for step in json.loads((tmp_path / "demo" / "summary.json").read_text())["steps"]] == [1, 2]
    assert not left, f"processes of the run's Ray outlived it: {sorted(left)}"


def test_a_placement_larger_than_the_cluster_or_a_slow_start_is_refused_in_one_line(tmp_path: Path) -> None:
    """Asked for more than the cluster has: refused before any actor starts, naming both. A server
    that does not start in time: named by its role (the only env server is not "server 0", whichever role is still silent), with
    its log and what to run next. Both advise --debug, which --help shows."""
    result, left = train_as_typed(tmp_path / "small", "--set", "cluster.num_cpus=1", timeout_s=180)
    lines = result.stderr.strip().splitlines()[-2:]  # (before them: the run directory, Ray's own notices)
    assert result.returncode == 1 and len(lines) == 2, result.stderr[-3000:]
    assert lines[0] == ("sciproto train: error: the run's servers ask Ray for {CPU: 3} in all, and the cluster "
                        "offers {CPU: 1}: --set cluster.num_cpus=N gives the local Ray N logical CPUs"), lines[0]
    assert lines[1] == cli_errors.DEBUG_HINT
    assert not list((tmp_path / "small").glob("*/*.log")), "an actor started"
    assert not left, f"processes of the run's Ray outlived it: {sorted(left)}"

    result, left = train_as_typed(tmp_path / "slow", "--set", "cluster.start_timeout_s=1", timeout_s=180)
    lines = result.stderr.strip().splitlines()[-2:]  # (before them: the run directory, Ray's own notices)
    assert result.returncode == 1 and len(lines) == 2, result.stderr[-3000:]
    # Which server is still silent at 1 s depends on the machine (a quiet one starts the env
    # server in time and the policy server not): either way it is named by its role and its log.
    said = re.match(r"sciproto train: error: the (env|policy) server on Ray did not start within 1 s ", lines[0])
    assert said, lines[0]
    assert f"(its log: {tmp_path / 'slow' / 'demo' / said[1]}.log)" in lines[0], lines[0]
    assert "server 0" not in lines[0]
    assert not left, f"processes of the run's Ray outlived it: {sorted(left)}"

    assert "--debug" in subprocess.run([str(SCIPROTO), "train", "--help"], capture_output=True, text=True,
                                       timeout=60, check=True).stdout


def test_the_demo_trains_to_its_target_with_each_server_on_its_node(
        cluster: tuple[Any, dict[str, Any]], tmp_path: Path) -> None:
    """Each role's actor on the node it asked for, serving real clients; the run to its target;
    then every server drained, not killed, and every actor gone."""
    _, nodes = cluster
    config = demo_config(tmp_path).model_copy(update={"cluster": PLACEMENT})
    engine = PlacedEngine(PLACEMENT, check_clients=True)
    outcome = train(config, engine=engine)
    assert engine.placed == {"env": [nodes["rollout"].node_id], "policy": [nodes["gpu"].node_id],
                             "learner": [nodes["trainer"].node_id]}
    assert outcome.stopped_by == "target_reward", outcome.stopped_by
    assert outcome.steps and outcome.checkpoint
    # Every group in exactly one fate, and the summary agrees with the learner's metrics.
    assert_accounted(outcome, tmp_path / "demo")
    # Every server wrote its log into the run directory and was stopped gracefully (drained).
    for name in ("env", "policy", "learner"):
        assert "draining in-flight calls" in (tmp_path / "demo" / f"{name}.log").read_text(), name
    for role in ("env", "policy", "learner"):
        for actor in engine.servers.actors[role]:
            assert not actor_state(actor) or actor_state(actor).get("State") == "DEAD"
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(actor.address.remote(), timeout=30)



# Two steps of two groups of uneven sizes: the ranks get different numbers of sequences.
RANK_REWARDS = [(1.0, 0.0, 0.5), (0.0, 1.0), (0.25, 1.0, 0.0, 0.5), (1.0, 0.5)]


def rank_groups(version: int = 0, prefix: str = "g") -> list[learner_pb2.RolloutGroup]:
    """Fixed groups of byte tokens (a 4-token prompt, 3 to 9 completion tokens), sampled at `version`."""
    rng = random.Random(7)
    groups = []
    for number, rewards in enumerate(RANK_REWARDS):
        rollouts = []
        for index, reward in enumerate(rewards):
            completion = 3 + rng.randrange(7)
            rollouts.append(learner_pb2.Rollout(
                sample_index=index, token_ids=[rng.randrange(256) for _ in range(4 + completion)],
                loss_mask=[0] * 4 + [1] * completion,
                rollout_logprobs=[0.0] * 4 + [-5.5 + rng.uniform(-0.5, 0.5) for _ in range(completion)],
                version_spans=[common_pb2.VersionSpan(start=4, end=4 + completion, policy_version=version)],
                reward=common_pb2.Reward(value=reward, status=common_pb2.REWARD_STATUS_SCORED), turns=1))
        groups.append(learner_pb2.RolloutGroup(group_id=f"{prefix}{number}", env="toy", task_id="train/0",
                                               rollouts=rollouts))
    return groups


async def train_steps(target: str, groups: list[learner_pb2.RolloutGroup]) -> list[learner_pb2.TrainStepResponse]:
    """Send `groups` on one TrainStep stream, half-close it, and read it to its end; every event but
    the receipts (all accepted)."""
    async with make_channel(target) as channel:
        call = learner_grpc.LearnerServiceStub(channel).TrainStep()
        for group in groups:
            await call.write(learner_pb2.TrainStepRequest(group=group))
        await call.done_writing()
        events = []
        while (event := await asyncio.wait_for(call.read(), 120)) is not grpc.aio.EOF:
            events.append(event)
    assert all(e.receipt.accepted for e in events if e.WhichOneof("event") == "receipt"), events
    return [e for e in events if e.WhichOneof("event") != "receipt"]


def lose_rank_1(servers: RayServers) -> dict[str, Any]:
    """Kill learner rank 1, then feed rank 0 a batch: what the engine and the client see."""
    ray.kill(servers.followers[0], no_restart=True)
    deadline = time.monotonic() + 60
    while (failure := servers.failure()) is None:
        assert time.monotonic() < deadline, "the engine did not see rank 1 gone within 60 s"
        time.sleep(0.5)
    events = asyncio.run(train_steps(servers.targets("learner")[0], rank_groups(version=2, prefix="late")[:2]))
    return {"failure": failure, "events": events}


def train_learner_on_ray(ranks: int, run_dir: Path, then: Callable[[RayServers], dict[str, Any]] | None = None,
                         ) -> tuple[list[dict[str, Any]], dict[str, Any], list[str], dict[str, Any]]:
    """The learner alone, as `ranks` actors (one per node: STRICT_SPREAD), fed `rank_groups` over
    TrainStep (two steps, a checkpoint after the second), then `then` (what it saw), then stopped:
    its metrics lines, the weights of its step 2 checkpoint, each rank's node, what `then` saw."""
    from safetensors.torch import load_file

    from learner.checkpoint import latest_checkpoint as latest_trainer_checkpoint
    from learner.server_config import LearnerServerConfig

    settings = ClusterSettings(engine="ray", learner=LearnerResources(cpus=1, ranks=ranks),
                               learner_strategy="STRICT_SPREAD", start_timeout_s=240, stop_timeout_s=60)
    learner = LearnerServerConfig.model_validate({
        "model": "tiny", "run_dir": str(run_dir), "batch_groups": 2, "torch_threads": 1, "checkpoint_every": 2,
        # Two optimizer steps per batch: the pi_old pass and both steps run their collectives in step.
        "grpo": {"lr": 1e-2, "mini_batches": 2, "micro_batch_tokens": 40}})
    servers = RayServers(ray, settings, owns_ray=False, run_dir=run_dir)
    try:
        RayEngine(settings).start_learner(ray, servers, learner.model_dump(mode="json"), run_dir)
        nodes = ray.get([actor.node_id.remote() for actor in servers.actors["learner"] + servers.followers],
                        timeout=60)
        events = asyncio.run(train_steps(servers.targets("learner")[0], rank_groups()))
        assert [e.step.step for e in events] == [1, 2], events
        assert servers.failure() is None
        seen = then(servers) if then is not None else {}
    finally:
        servers.stop()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    checkpoint = latest_trainer_checkpoint(run_dir)
    assert checkpoint is not None and checkpoint.name == "step_00000002", checkpoint
    return metrics, load_file(str(checkpoint / "model.safetensors")), nodes, seen


def test_two_learner_ranks_on_two_nodes_train_like_one(cluster: tuple[Any, dict[str, Any]], tmp_path: Path) -> None:
    """The learner's two FSDP2 ranks as actors on two nodes (gloo, rendezvous at rank 0's node IP),
    rank 0 serving TrainStep to a real client: the same loss and gradient norm at each step and
    the same weights after them as one rank (tolerances of tests/learner/test_fsdp2.py); rank 1
    stops when rank 0 stops, after its final checkpoint."""
    _, nodes = cluster
    metrics, weights, placed, _ = train_learner_on_ray(2, tmp_path / "two")
    assert len(set(placed)) == 2 and set(placed) <= {node.node_id for node in nodes.values()}, placed
    expected_metrics, expected_weights, _, _ = train_learner_on_ray(1, tmp_path / "one")
    figures = [[m["step"], m["loss"], m["grad_norm"], m["tokens"]] for m in metrics]
    expected = [[m["step"], m["loss"], m["grad_norm"], m["tokens"]] for m in expected_metrics]
    assert [f[0] for f in figures] == [1, 2]
    torch.testing.assert_close(figures, expected, rtol=1e-5, atol=1e-7)
    assert set(weights) == set(expected_weights)
    for name, value in expected_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-3, atol=2e-4)
    assert "final checkpoint" in (tmp_path / "two" / "learner.log").read_text()
    assert "learner rank 1 stopped by rank 0" in (tmp_path / "two" / "learner-rank1.log").read_text()


def test_a_lost_learner_rank_stops_the_run_with_one_line_and_rank_0_does_not_hang(
        cluster: tuple[Any, dict[str, Any]], tmp_path: Path) -> None:
    """Two learner ranks train two steps, then rank 1 is killed: the engine names it in one line
    (the run's stop line), and rank 0's next step fails at once with one line instead of waiting
    on the lost rank, its groups given back and at last given up."""
    _, _, _, lost = train_learner_on_ray(2, tmp_path, then=lose_rank_1)
    assert lost["failure"].startswith("learner rank 1 on Ray is gone for good: "), lost["failure"]
    failures = [e.step_failure for e in lost["events"] if e.WhichOneof("event") == "step_failure"]
    assert failures and all("train_step failed on rank 0 of 2 learner ranks" in f.error.message
                            and "\n" not in f.error.message for f in failures), lost["events"]
    assert sorted(failures[-1].abandoned_group_ids) == ["late0", "late1"], failures


def lose_a_node_after(ray_cluster: Any, engine: PlacedEngine, role: str, by_id: dict[str, Any],
                      ready: Callable[[], bool], seen: dict[str, Any], comes_back: bool = True) -> None:
    """In a thread: once `ready()`, remove (kill) the node `role`'s server runs on and, when the
    role `comes_back`, wait until it runs on the other node of `by_id`; what it saw goes into `seen`."""
    try:
        deadline = time.monotonic() + 300
        while not ready():
            assert time.monotonic() < deadline, "the run did not get there within 300 s"
            time.sleep(0.2)
        seen["before"] = engine.servers.targets(role)
        (lost,) = engine.placed[role]
        seen["spare"] = next(node_id for node_id in by_id if node_id != lost)
        ray_cluster.remove_node(by_id[lost], allow_graceful=False)
        seen["removed_after_step"] = steps_in(engine.metrics)
        if not comes_back:
            return
        deadline = time.monotonic() + 240
        while (now := engine.servers.node_ids(role, timeout_s=240)) == [lost]:  # not yet declared dead
            assert time.monotonic() < deadline, f"the {role} actor was not restarted within 240 s"
            time.sleep(0.5)
        seen["after_node"] = now
        seen["after"] = engine.servers.targets(role, timeout_s=30)
    except BaseException as error:  # noqa: BLE001 - asserted by the test
        seen["error"] = error


def steps_in(metrics: Path | None) -> int:
    return len(metrics.read_text().splitlines()) if metrics is not None and metrics.exists() else 0


def assert_accounted(outcome: Any, run_dir: Path) -> None:
    """Every group in exactly one fate, and the summary agrees with the learner's metrics."""
    assert all(len(fates) == 1 for fates in outcome.group_fates.values())
    metrics = [json.loads(line) for line in Path(outcome.metrics).read_text().splitlines() if line.strip()]
    assert [int(m["step"]) for m in metrics] == [s.step for s in outcome.steps]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["groups_settled"] == outcome.groups_settled
    assert sum(outcome.groups_settled.values()) + outcome.groups_pending == len(outcome.group_fates)


def test_the_policy_node_then_the_env_node_are_lost_mid_run_and_each_server_comes_back_on_a_live_node(
        cluster: tuple[Any, dict[str, Any]], tmp_path: Path) -> None:
    """One run, two faults. Adds a second GPU node and a second rollout node. At step 2 it removes
    (kills, not drains) the node the policy server runs on: its actor restarts in its placement
    group on the other, the learner is told its new address and reconciles its weights. Two steps
    later it removes the env server's node: its actor comes back on the other rollout node and
    the client's replica pool finds it there. The run reaches its target with every group in one fate."""
    ray_cluster, nodes = cluster
    spares = {"policy": ray_cluster.add_node(num_cpus=1, num_gpus=1, object_store_memory=STORE),
              "env": ray_cluster.add_node(num_cpus=1, resources={"rollout": 1}, object_store_memory=STORE)}
    ray_cluster.wait_for_nodes()
    by_id = {role: {node.node_id: node for node in (nodes[name], spares[role])}
             for role, name in (("policy", "gpu"), ("env", "rollout"))}
    config = demo_config(tmp_path, "learner.reconcile_interval_s=2").model_copy(update={"cluster": PLACEMENT})
    engine = PlacedEngine(PLACEMENT)
    seen: dict[str, dict[str, Any]] = {"policy": {}, "env": {}}

    def lose_the_policy_node_then_the_env_node() -> None:
        lose_a_node_after(ray_cluster, engine, "policy", by_id["policy"], lambda: steps_in(engine.metrics) >= 2,
                          seen["policy"])
        if "error" not in seen["policy"]:
            later = seen["policy"]["removed_after_step"] + 2
            lose_a_node_after(ray_cluster, engine, "env", by_id["env"], lambda: steps_in(engine.metrics) >= later,
                              seen["env"])

    remover = threading.Thread(target=lose_the_policy_node_then_the_env_node, daemon=True)
    remover.start()
    outcome = train(config, engine=engine)
    remover.join(60)
    for role in ("policy", "env"):
        assert "error" not in seen[role], (role, seen[role].get("error"))
        assert seen[role]["after_node"] == [seen[role]["spare"]] and seen[role]["after"] != seen[role]["before"], seen
    assert outcome.stopped_by == "target_reward", outcome.stopped_by
    assert outcome.steps[-1].step > seen["policy"]["removed_after_step"] + 1
    assert outcome.steps[-1].step > seen["env"]["removed_after_step"]
    learner_log = (tmp_path / "demo" / "learner.log").read_text()
    assert f"policy server 0 moved to {seen['policy']['after'][0]}" in learner_log
    assert "re-pushed version" in learner_log
    # Steps after the move sampled from the restarted server at the learner's versions: the
    # policy lag stays bounded by max_staleness (1), so it was not left serving version 0.
    assert all(s.policy_lag_mean <= 1.0 for s in outcome.steps if s.step > seen["policy"]["removed_after_step"] + 2)
    assert_accounted(outcome, tmp_path / "demo")


def test_the_learner_node_is_lost_the_run_stops_with_one_line_and_a_rerun_resumes_from_its_checkpoint(
        cluster: tuple[Any, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Adds a second trainer node and removes (kills) the one the learner runs on once it has a
    checkpoint: the learner is never restarted, so the run stops with one line (as `sciproto
    train` prints it) that says so; a rerun starts the learner on the other node, from that
    checkpoint, and trains on from the step after it."""
    ray_cluster, nodes = cluster
    spare = ray_cluster.add_node(num_cpus=1, resources={"trainer": 1}, object_store_memory=STORE)
    ray_cluster.wait_for_nodes()
    by_id = {node.node_id: node for node in (nodes["trainer"], spare)}
    config = demo_config(tmp_path, "learner.checkpoint_every=2").model_copy(update={"cluster": PLACEMENT})
    run_dir = tmp_path / "demo"
    engine = PlacedEngine(PLACEMENT)
    seen: dict[str, Any] = {}
    remover = threading.Thread(target=lose_a_node_after, daemon=True, args=(
        ray_cluster, engine, "learner", by_id, lambda: trained_steps(run_dir) >= 2, seen), kwargs={"comes_back": False})
    remover.start()
    status = cli_errors.run(lambda: train(config, engine=engine), command="sciproto train")
    remover.join(60)
    assert "error" not in seen, seen.get("error")
    err = capsys.readouterr().err
    assert status == cli_errors.EXIT_FAILED, err
    assert "Traceback" not in err, err
    checkpoint, path = trained_steps(run_dir), latest_checkpoint(run_dir)
    assert checkpoint >= 2
    # One line: which server, that its node was lost, and where a rerun starts; no hint that
    # does not apply (the address was right; the node is gone).
    (line,) = [text for text in err.splitlines() if text.startswith("sciproto train: error:")]
    assert "the learner server" in line and "node" in line and "was lost" in line, line
    assert f"a rerun resumes from its checkpoint of step {checkpoint}" in line, line
    assert "is the server running" not in line and "UNAVAILABLE" not in line, line
    rerun = demo_config(tmp_path, "learner.checkpoint_every=2", f"budget.max_steps={checkpoint + 2}")
    engine = PlacedEngine(PLACEMENT)
    outcome = train(rerun.model_copy(update={"cluster": PLACEMENT}), engine=engine)
    assert engine.placed["learner"] == [seen["spare"]]
    assert Path(outcome.run_dir) == run_dir
    assert [s.step for s in outcome.steps] == [checkpoint + 1, checkpoint + 2], outcome.steps
    assert f"resumed from {path}: step {checkpoint}," in (run_dir / "learner.log").read_text()
    # metrics.jsonl: the first run's steps up to the checkpoint, then the rerun's.
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [int(m["step"]) for m in metrics] == list(range(1, checkpoint + 3))
    assert trained_steps(run_dir) == checkpoint + 2
