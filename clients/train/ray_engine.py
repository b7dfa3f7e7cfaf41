"""The Ray engine of `sciproto train --cluster ray`: each server is a Ray actor
(`clients.train.ray_actor.ServerHost`), placed as the `cluster` section says
(`clients.train.cluster`).

Env servers spread over the nodes that have what they ask for; policy servers run in a placement
group, one bundle (CPUs, GPUs, custom resources) per replica; the learner is one actor and is
never restarted (a lost learner stops the run, and a rerun resumes from its last checkpoint). With
`cluster.learner.ranks` > 1 the learner is that many data-parallel FSDP2 ranks, one actor each in a
placement group of its own (`cluster.learner_strategy`; `clients.train.ray_learner`): rank 0 serves
LearnerService, the others follow its collective calls (`learner.ranks`), are stopped after it, and
a lost rank stops the run as a lost learner does. Run here: two ranks on two nodes of a simulated
cluster (gloo on the CPU) train like one; not run: ranks on GPUs (NCCL) or on several real
machines. The rollout client runs in the driver, as with the local engine. An env or policy actor that Ray
restarts comes back at a new address: `RayServers.targets` reports it (the rollout pools ask), and
a moved policy server is handed to the learner, which reconciles its weights.

    cluster:
      env: {replicas: 2, cpus: 1}
      policy: {replicas: 1, cpus: 1, gpus: 1}
      learner: {cpus: 1, gpus: 1, resources: {trainer: 1}, ranks: 2}   # one GPU per rank
      learner_strategy: STRICT_SPREAD                                   # each rank on a node of its own

Ray is imported only when a Ray run starts: `pip install 'sciproto[ray]'`. The learner writes its
metrics and checkpoints to the run directory on its own node: on more than one machine that
directory must be on a filesystem every node sees (or the learner pinned, with a custom resource,
to the driver's node).
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from clients.train.cluster import ClusterSettings, RoleResources
from clients.train.ray_actor import ServerHost, one_line
from clients.train.ray_learner import learner_placement_group, rank_options
from clients.train.resume import trained_steps
from sciproto.config import ConfigError

if TYPE_CHECKING:
    from clients.train.config import TrainConfig

log = logging.getLogger(__name__)

ROLES = ("env", "policy", "learner")
STOP_ORDER = ("learner", "policy", "env")  # the learner checkpoints, then what it talks to
RAY_EXTRA = "pip install 'sciproto[ray]'"


def import_ray() -> Any:
    """Ray, or a ConfigError saying what to install."""
    try:
        import ray
    except ImportError:
        raise ConfigError(f"--cluster ray needs Ray, which is not installed here: {RAY_EXTRA}") from None
    return ray


class RayServers:
    """The servers of one run on Ray (`clients.train.engine.Servers`)."""

    def __init__(self, ray: Any, settings: ClusterSettings, owns_ray: bool, run_dir: Path | None = None) -> None:
        self._ray = ray
        self.settings = settings
        self.owns_ray = owns_ray  # this run started Ray and shuts it down
        self.run_dir = run_dir
        self.actors: dict[str, list[Any]] = {role: [] for role in ROLES}
        self.followers: list[Any] = []  # the learner's ranks 1.. (cluster.learner.ranks > 1)
        self.placement_groups: list[Any] = []
        self._targets: dict[str, list[str]] = {role: [] for role in ROLES}
        self._dead: dict[str, str] = {}
        self._learner_knows: dict[int, str] = {}  # policy server -> the address the learner pushes to
        self._stopped = False

    # what the engine interface asks

    def targets(self, role: str, timeout_s: float = 2.0) -> list[str]:
        """The current `host:port` of each replica of `role`: asked of the actors (within
        `timeout_s`); a replica that is restarting keeps its last known address until it answers."""
        actors = self.actors[role]
        known = self._targets[role]
        refs = [actor.address.remote() for actor in actors]
        ready, _ = self._ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        done = set(ready)
        for index, ref in enumerate(refs):
            if ref not in done:
                continue
            try:
                known[index] = self._ray.get(ref)
            except self._ray.exceptions.RayActorError as error:
                if _is_dead_for_good(self._ray, actors[index]):
                    self._dead.setdefault(self._name(role, index), why_dead(actors[index], one_line(error)))
        if role == "policy":
            self._follow_policy(list(known))
        return list(known)

    def _follow_policy(self, targets: list[str]) -> None:
        """Tell the learner of each policy server that moved (it pushes there from now on)."""
        for index, target in enumerate(targets):
            if self._learner_knows.get(index) in (None, target) or not self.actors["learner"]:
                self._learner_knows.setdefault(index, target)
                continue
            log.warning("policy server %d moved to %s; telling the learner", index, target)
            try:
                self._ray.get(self.actors["learner"][0].retarget_policy.remote(index, target), timeout=60)
            except self._ray.exceptions.RayError as error:
                log.warning("could not tell the learner (asked again later): %s", one_line(error))
                continue
            self._learner_knows[index] = target

    def node_ids(self, role: str, timeout_s: float = 30.0) -> list[str]:
        """The Ray node id each replica of `role` runs on now; a replica that is restarting is
        asked again until it answers (within `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self._ray.get([actor.node_id.remote() for actor in self.actors[role]],
                                     timeout=max(1.0, deadline - time.monotonic()))
            except self._ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def _name(self, role: str, index: int) -> str:
        return f"the {role} server" if len(self.actors[role]) == 1 else f"{role} server {index}"

    def failure(self) -> str | None:
        """One line naming a role whose server is gone for good, why (its node was lost, ...) and
        where a rerun starts, else None. Also hands the learner the new address of a policy
        server that moved (polled by the training loop)."""
        self.targets("policy", timeout_s=0.5)
        named = [(self._name(role, index), actor) for role in ROLES for index, actor in enumerate(self.actors[role])]
        named += [(f"learner rank {rank}", actor) for rank, actor in enumerate(self.followers, start=1)]
        for name, actor in named:
            if name not in self._dead and _is_dead_for_good(self._ray, actor):
                self._dead[name] = why_dead(actor)
        if not self._dead:
            return None
        name, why = next(iter(self._dead.items()))
        step = trained_steps(self.run_dir) if self.run_dir is not None else 0
        rerun = (f"a rerun resumes from its checkpoint of step {step}" if step
                 else f"a rerun starts over (no checkpoint in {self.run_dir})")
        return f"{name} on Ray is gone for good: {why}; {rerun}"

    def stop(self) -> None:
        """Learner first (it checkpoints, then stops its other ranks, which stop next), then policy,
        then env; each bounded; then the actors, placement groups and (when this run started it)
        Ray itself go. A role whose servers never all started (a run that failed to start) is not
        asked to stop: its actors are killed at once, not waited for."""
        if self._stopped:
            return
        self._stopped = True
        ray = self._ray
        try:
            for role, said, actors in self._in_stop_order():
                started = bool(self._targets[role])
                refs = [actor.stop.remote(self.settings.stop_timeout_s) for actor in actors] if started else []
                if refs:
                    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.settings.stop_timeout_s + 5)
                    for ref in ready:
                        try:
                            ray.get(ref)
                        except ray.exceptions.RayError as error:
                            log.warning("%s stopped with an error: %s", said, one_line(error))
                for actor in actors:
                    ray.kill(actor, no_restart=True)
            for group in self.placement_groups:
                ray.util.remove_placement_group(group)
        finally:
            if self.owns_ray:
                ray.shutdown()

    def _in_stop_order(self) -> list[tuple[str, str, list[Any]]]:
        """(role, how a log line names its actors, the actors): the learner's ranks 1.. right after rank 0."""
        ordered = [(role, f"{role} server", self.actors[role]) for role in STOP_ORDER]
        return [ordered[0], ("learner", "learner rank", self.followers), *ordered[1:]]


def actor_state(actor: Any) -> dict[str, Any]:
    """What the cluster's control store (GCS) holds of `actor`: "State" (ALIVE, RESTARTING, DEAD,
    ...), "NumRestarts", "Address" (its node), "DeathCause". Read from the GCS directly (Ray's
    developer API), so it needs no dashboard."""
    from ray._private import state

    return state.actors(actor_id=actor._actor_id.hex()) or {}


def why_dead(actor: Any, otherwise: str = "its actor died and Ray will not restart it") -> str:
    """Why Ray says `actor` died, in a few words (its node was lost, it ran out of memory, its
    process exited), from the GCS's death cause; `otherwise` when the GCS does not say."""
    try:
        cause = actor_state(actor).get("DeathCause")
    except Exception:  # noqa: BLE001 - the GCS is out of reach
        return otherwise
    if cause is None:
        return otherwise
    if cause.HasField("oom_context"):
        return "its node ran out of memory and Ray killed it"
    if cause.HasField("creation_task_failure_context"):
        return "its server failed to start again (see its log in the run directory)"
    if not cause.HasField("actor_died_error_context"):
        return otherwise
    context = cause.actor_died_error_context
    reason = type(context).Reason.Name(context.reason)
    if reason == "NODE_DIED":
        return f"its node {context.node_ip_address} was lost" if context.node_ip_address else "its node was lost"
    if reason == "WORKER_DIED":
        return "its process died (see its log in the run directory)"
    first = context.error_message.strip().splitlines()
    return first[0] if first else otherwise


def _is_dead_for_good(ray: Any, actor: Any) -> bool:
    """Whether Ray reports `actor` DEAD (not RESTARTING): it will not come back."""
    try:
        return actor_state(actor).get("State") == "DEAD"
    except Exception:  # noqa: BLE001 - the GCS is out of reach: a failed call will tell
        return False


def check_servers_may_listen(config: Any, node_ip: str) -> None:
    """Refuse, before any actor starts, servers that would refuse to listen on the nodes' address:
    plaintext on an address other machines reach needs TLS or an explicit opt-in."""
    from sciproto.server import ServerConfig

    for role in ("env", "policy", "learner"):
        server = getattr(config, role).server
        try:
            ServerConfig.model_validate({**server.model_dump(), "host": node_ip, "port": 0})
        except ValidationError:
            raise ConfigError(
                f"the {role} server would serve plaintext on {node_ip}, which other machines can reach: set"
                f" {role}.server.tls (cert and key), or, on a trusted network only, --set"
                f" {role}.server.allow_insecure_remote=true (for each of env, policy and learner)") from None


def placement_asks(settings: ClusterSettings) -> dict[str, float]:
    """What the run's servers reserve together: each role's bundle times its replicas (ranks)."""
    asks: dict[str, float] = {}
    for resources, count in ((settings.env, settings.env.replicas), (settings.policy, settings.policy.replicas),
                             (settings.learner, settings.learner.ranks)):
        for name, amount in resources.bundle().items():
            asks[name] = asks.get(name, 0.0) + amount * count
    return asks


def _amounts(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{name}: {amount:g}" for name, amount in resources.items()) + "}"


def check_room(settings: ClusterSettings, nodes: list[dict[str, float]], owns_ray: bool) -> None:
    """Refuse, in one line naming both, a placement that the cluster's live nodes (`nodes`: the
    resources of each) cannot hold: more of a resource in all than they offer together, or a
    replica's bundle larger than any one node."""
    asks = placement_asks(settings)
    offers: dict[str, float] = {}
    for node in nodes:
        for name, amount in node.items():
            offers[name] = offers.get(name, 0.0) + amount
    short = [name for name, amount in asks.items() if amount > offers.get(name, 0.0) + 1e-9]
    too_big = [(role, resources.bundle()) for role, resources in
               (("env", settings.env), ("policy", settings.policy), ("learner", settings.learner))
               if not any(all(node.get(k, 0.0) >= v - 1e-9 for k, v in resources.bundle().items()) for node in nodes)]
    if not short and not too_big:
        return
    shown = {name: offers.get(name, 0.0) for name in asks} | {
        name: amount for name, amount in offers.items() if name in ("CPU", "GPU")}
    fix = ("--set cluster.num_cpus=N gives the local Ray N logical CPUs" if owns_ray and "CPU" in short
           else "lower cluster.{env,policy,learner} cpus/gpus/resources or replicas, or add nodes that have them")
    if short:
        raise ConfigError(f"the run's servers ask Ray for {_amounts(asks)} in all, and the cluster offers "
                          f"{_amounts(shown)}: {fix}")
    role, bundle = too_big[0]
    raise ConfigError(f"each {role} server asks Ray for {_amounts(bundle)} on one node, and no node of the cluster "
                      f"offers that (its nodes: {'; '.join(_amounts(node) for node in nodes)}): {fix}")


def live_node_resources(ray: Any) -> list[dict[str, float]]:
    """The resources of each live node, less Ray's own bookkeeping (memory, node:... keys)."""
    return [{name: amount for name, amount in node["Resources"].items()
             if not name.startswith("node:") and name not in ("memory", "object_store_memory")}
            for node in ray.nodes() if node.get("Alive")]


def connect(ray: Any, settings: ClusterSettings) -> bool:
    """Join the cluster at `settings.address` (or RAY_ADDRESS), else start a local Ray for this run:
    on loopback, with a bounded object store, usage stats off, and as many logical CPUs as the
    machine has or the placement asks for, whichever is more (`cluster.num_cpus` sets it). True
    when this run started Ray (and must shut it down)."""
    if ray.is_initialized():
        return False
    address = settings.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)  # each server logs to <run_dir>/<role>.log
        return False
    # Ray's own daemons read this when they start: no usage report. (Its dashboard process still
    # asks the cloud metadata address which cloud it runs on at start-up, whatever this says.)
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    num_cpus = settings.num_cpus or max(os.cpu_count() or 1, math.ceil(placement_asks(settings).get("CPU", 0.0)))
    # address="local": a new Ray for this run, never one that `ray start` left running here.
    ray.init(address="local", num_cpus=num_cpus, object_store_memory=settings.object_store_mb * 2**20,
             include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    return True


class RayEngine:
    """Start a run's servers as Ray actors (`clients.train.engine.Engine`)."""

    def __init__(self, settings: ClusterSettings) -> None:
        self.settings = settings

    def start(self, config: TrainConfig, run_dir: Path) -> RayServers:
        """Env and policy actors side by side, then the learner once the policy addresses are known."""
        ray = import_ray()
        settings = self.settings
        owns_ray = connect(ray, settings)
        run_dir = run_dir.resolve()
        servers = RayServers(ray, settings, owns_ray, run_dir)
        try:
            self._start(ray, servers, config, run_dir)
        except BaseException:
            servers.stop()
            raise
        return servers

    def _start(self, ray: Any, servers: RayServers, config: Any, run_dir: Path) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        check_servers_may_listen(config, ray.util.get_node_ip_address())
        settings = self.settings
        check_room(settings, live_node_resources(ray), servers.owns_ray)
        hint = _timeout_hint(settings, servers.owns_ray)
        host = ray.remote(ServerHost)
        timeout_s = settings.start_timeout_s

        def actor(role: str, index: int, resources: RoleResources, section: dict[str, Any], **options: Any) -> Any:
            name = role if resources.replicas == 1 else f"{role}-{index}"
            return host.options(
                num_cpus=resources.cpus, num_gpus=resources.gpus, resources=resources.resources or None,
                max_restarts=resources.max_restarts, max_concurrency=4, **options,
            ).remote(role, section, str(run_dir / f"{name}.log"), timeout_s)

        env_section = config.env.model_dump(mode="json")
        servers.actors["env"] = [actor("env", i, settings.env, env_section, scheduling_strategy="SPREAD")
                                 for i in range(settings.env.replicas)]
        group = ray.util.placement_group([settings.policy.bundle()] * settings.policy.replicas,
                                         strategy=settings.policy_strategy)
        servers.placement_groups.append(group)
        ready, _ = ray.wait([group.ready()], timeout=timeout_s)
        if not ready:
            raise ConfigError(
                f"the cluster has no room for {settings.policy.replicas} policy bundle(s) of "
                f"{settings.policy.bundle()} within {timeout_s:g} s (ray status shows what it has)")
        policy_section = config.policy.model_dump(mode="json")
        servers.actors["policy"] = [
            actor("policy", i, settings.policy, policy_section,
                  scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i))
            for i in range(settings.policy.replicas)
        ]
        for role in ("env", "policy"):
            servers._targets[role] = _addresses(ray, _names(role, settings.env.replicas if role == "env" else
                                                            settings.policy.replicas), servers.actors[role],
                                                timeout_s, run_dir, hint)
        learner = config.learner.model_copy(update={
            "policy_targets": servers._targets["policy"], "run_dir": run_dir, "max_steps": config.budget.max_steps,
            "stop_step_wait_s": settings.stop_timeout_s / 2,  # half for the step in flight, half to save
        })
        self.start_learner(ray, servers, learner.model_dump(mode="json"), run_dir, hint)

    def start_learner(self, ray: Any, servers: RayServers, section: dict[str, Any], run_dir: Path,
                      hint: str = "") -> None:
        """The learner from its config `section`: one actor, or with `cluster.learner.ranks` > 1 one
        actor per rank in a placement group (`clients.train.ray_learner`); returns once rank 0
        serves and every other rank follows it."""
        settings = self.settings
        resources = settings.learner
        options = {"num_cpus": resources.cpus, "num_gpus": resources.gpus, "resources": resources.resources or None,
                   "max_restarts": resources.max_restarts, "max_concurrency": 4}
        host = ray.remote(ServerHost)
        timeout_s = settings.start_timeout_s
        if resources.ranks == 1:
            servers.actors["learner"] = [host.options(**options).remote(
                "learner", section, str(run_dir / "learner.log"), timeout_s)]
            servers._targets["learner"] = _addresses(ray, ["learner"], servers.actors["learner"], timeout_s,
                                                     run_dir, hint)
            return
        group = learner_placement_group(ray, resources, settings.learner_strategy, timeout_s)
        servers.placement_groups.append(group)
        ranks = [host.options(**options, **placement).remote("learner", section, str(run_dir / log_name), timeout_s)
                 for placement, log_name in rank_options(ray, group, resources.ranks)]
        servers.actors["learner"], servers.followers = ranks[:1], ranks[1:]
        servers._targets["learner"] = _addresses(
            ray, [f"learner-rank{rank}" if rank else "learner" for rank in range(resources.ranks)], ranks, timeout_s,
            run_dir, hint)[:1]


def _names(role: str, replicas: int) -> list[str]:
    """The log-file stem of each replica (`<role>` for one, `<role>-<i>` for several)."""
    return [role] if replicas == 1 else [f"{role}-{i}" for i in range(replicas)]


def _said(stem: str) -> str:
    """How a message names the server whose log is `<stem>.log`."""
    if stem.startswith("learner-rank"):
        return f"learner rank {stem.removeprefix('learner-rank')}"
    role, _, index = stem.partition("-")
    return f"{role} server {index}" if index else f"the {role} server"


def _timeout_hint(settings: ClusterSettings, owns_ray: bool) -> str:
    """What a user can still run once a server did not start in time (a run's own Ray is gone by then)."""
    more = f"--set cluster.start_timeout_s={2 * settings.start_timeout_s:g} waits longer"
    if owns_ray:
        return more
    address = settings.address or os.environ.get("RAY_ADDRESS", "")
    where = f" --address {address}" if address and "://" not in address else ""
    return f"`ray status{where}` shows what the cluster has free; {more}"


def _addresses(ray: Any, stems: list[str], actors: list[Any], timeout_s: float, run_dir: Path,
               hint: str = "") -> list[str]:
    """Each actor's address once its server listens (a learner rank other than 0: once it follows
    rank 0), or a one-line error naming the server (`stems`: the name of each one's log): the first
    that fails, or the first still silent at `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    refs = [actor.address.remote() for actor in actors]
    addresses: dict[int, str] = {}
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            stem = stems[next(i for i in range(len(refs)) if i not in addresses)]
            raise ConfigError(f"{_said(stem)} on Ray did not start within {timeout_s:g} s (its log: "
                              f"{run_dir / stem}.log){'; ' + hint if hint else ''}")
        index = refs.index(ready[0])
        try:
            addresses[index] = ray.get(ready[0])
        except ray.exceptions.RayActorError as error:
            cause = getattr(error, "cause", None) or error
            raise ConfigError(f"{_said(stems[index])} on Ray did not start: {one_line(cause)} (its log: "
                              f"{run_dir / stems[index]}.log)") from None
    return [addresses[i] for i in range(len(refs))]


__all__ = ["RAY_EXTRA", "RayEngine", "RayServers", "actor_state", "check_room", "check_servers_may_listen", "connect",
           "import_ray", "live_node_resources", "placement_asks", "why_dead"]
