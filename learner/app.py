"""`sciproto serve learner`: build the model the policy servers serve, learn the dtype they serve
it in, resume from the run directory, start LearnerService, serve until SIGTERM/SIGINT (then save
a final checkpoint).

With several data-parallel ranks (WORLD_SIZE > 1, with RANK, MASTER_ADDR and MASTER_PORT, as
torchrun or the Ray engine sets them), every rank joins the process group and builds the same
trainer (FSDP2 shards it); rank 0 serves LearnerService and the others follow its collective calls
(learner/ranks.py) until its shutdown, after the final checkpoint, stops them."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading
from collections.abc import Sequence

import torch

from learner import lora_limits
from learner.metrics import MetricsLogger
from learner.ranks import LeaderGone, RankEnv, Ranks, RanksFailed, follow, join
from learner.server_config import LearnerServerConfig
from learner.service import LearnerServicer
from learner.trainer import GRPOTrainer
from learner.weight_push import build_weight_pusher
from sciproto.auth import Authenticator
from sciproto.client.policy import PolicyClient
from sciproto.config import ConfigError, load_component_config
from sciproto.hardware import auto_precision
from sciproto.pb import LEARNER_SERVICE, learner_grpc
from sciproto.server import (
    RunningServer,
    Service,
    announce_port,
    serve_until_signalled,
    start_server,
)
from sciproto.tracing import server_interceptors, setup_tracing, shutdown_tracing
from sciproto.weights.wire import PROTO_TO_DTYPE

log = logging.getLogger("learner")

SECTION = "learner"  # in a config file shared by every component, the learner reads this section


def load_learner_config(config: str | None, overrides: Sequence[str] = ()) -> LearnerServerConfig:
    """A learner config file, or the `learner:` section of a file that configures several components."""
    return load_component_config(LearnerServerConfig, config, overrides, SECTION)


def resolve_precision(config: LearnerServerConfig) -> LearnerServerConfig:
    """`grpo.precision: auto` made concrete for the learner's device (sciproto.hardware)."""
    if config.grpo.precision != "auto":
        return config
    precision, reason = auto_precision(config.device)
    log.info("precision auto: %s compute (%s)", precision, reason)
    return config.model_copy(update={"grpo": config.grpo.model_copy(update={"precision": precision})})


def build_trainer(config: LearnerServerConfig) -> tuple[GRPOTrainer, str]:
    """The trainer over the same model the policy servers load (same spec and seed); with
    `config.lora`, a LoRA adapter over it, the model frozen (learner/lora.py)."""
    from sciproto.models import load_model

    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    loaded = load_model(config.model, torch.float32, seed=config.model_seed, device=config.device)
    model = loaded.model.requires_grad_(True)  # load_model hands out an inference-only model
    trainer = GRPOTrainer(model, config.grpo, pad_token_id=loaded.tokenizer.pad_token_id, lora=config.lora,
                          model_name=loaded.name)
    return trainer, loaded.name


async def resolve_push_dtype(config: LearnerServerConfig) -> torch.dtype:
    """The dtype the weight pushes carry: `push_dtype`, or for "auto" the dtype every policy server
    reports in Describe (fp32 without policy servers). The trainer's weights stay fp32 either way."""
    if config.push_dtype != "auto":
        return getattr(torch, config.push_dtype)
    if not config.policy_targets:
        return torch.float32
    clients = [PolicyClient(config.policy_access.channel(t)) for t in config.policy_targets]
    try:
        described = await asyncio.gather(*(c.describe(timeout_s=config.push_timeout_s) for c in clients))
    finally:
        await asyncio.gather(*(c.close() for c in clients))
    served = {target: PROTO_TO_DTYPE.get(d.dtype) for target, d in zip(config.policy_targets, described)}
    if None in served.values() or len(set(served.values())) != 1:
        listed = ", ".join(f"{t}: {d or 'not reported'}" for t, d in served.items())
        raise ConfigError(
            f"push_dtype auto needs every policy server to report one and the same dtype ({listed}); "
            "serve one dtype everywhere or set learner.push_dtype"
        )
    return getattr(torch, next(iter(served.values())))


async def serve(config: LearnerServerConfig, authenticator: Authenticator | None) -> None:
    if RankEnv.from_environ().rank > 0:
        await _follow_until_stopped(config)
        return
    setup_tracing(config.tracing, "sciproto-learner")
    try:
        running = await start(config, authenticator)
        await serve_until_signalled(running, on_ready=lambda port: announce_port("learner", port))
    finally:
        shutdown_tracing()


async def _follow_until_stopped(config: LearnerServerConfig) -> None:
    """A follower under a launcher that signals every rank: rank 0 stops it after its final
    checkpoint (a collective this rank takes part in), so a signal here waits for that."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: log.info("signal received; rank 0 stops this rank"))
    running = await start(config, None)
    await running.wait()


class RunningFollower:
    """A learner rank other than 0: it serves nothing and runs rank 0's collective calls
    (`learner.ranks.follow`) in a thread of its own until rank 0 says stop. `wait` raises what
    ended it otherwise (rank 0 gone, a failed call)."""

    port = 0
    services: tuple = ()

    def __init__(self, following: asyncio.Future[None], stopping: threading.Event) -> None:
        self._following = following
        self._stopping = stopping

    async def wait(self) -> None:
        await asyncio.shield(self._following)

    async def stop(self, timeout_s: float = 600.0) -> None:
        """Wait (at most `timeout_s`) for rank 0 to say stop; past that, stop waiting for it."""
        done, _ = await asyncio.wait({self._following}, timeout=timeout_s)
        if not done:
            log.error("rank 0 did not stop this learner rank within %.0f s; leaving", timeout_s)
            self._stopping.set()


async def start(
    config: LearnerServerConfig, authenticator: Authenticator | None
) -> RunningServer | RunningFollower:
    """Join the ranks (with several), build the trainer, resume, and start serving; returns at
    once (stopping the server saves the final checkpoint). `serve` waits for a signal around it; a
    cluster engine's actor calls it directly. On a rank other than 0: the follower."""
    rank_env = RankEnv.from_environ()
    config = resolve_precision(config)
    lora_limits.refuse_unsupported(config.lora, world_size=rank_env.world_size)  # before the ranks wait for each other
    store = await asyncio.to_thread(join, rank_env)
    trainer, model_name = build_trainer(config)
    if rank_env.rank > 0:
        assert store is not None
        stopping = threading.Event()
        following = asyncio.ensure_future(asyncio.to_thread(follow, trainer, store, stopping=stopping))
        log.info("learner rank %d of %d follows rank 0 at %s:%d", rank_env.rank, rank_env.world_size,
                 rank_env.master_addr, rank_env.master_port)
        return RunningFollower(following, stopping)
    trainer.push_dtype = await resolve_push_dtype(config)
    pusher = build_weight_pusher(config) if config.policy_targets else None
    metrics = MetricsLogger(config.run_dir, config.metrics)
    servicer = LearnerServicer(config, trainer, pusher, metrics, model_name, Ranks(trainer, store))
    await servicer.start()
    running = await start_server(
        config.server,
        [Service(LEARNER_SERVICE, servicer, learner_grpc.add_LearnerServiceServicer_to_server)],
        interceptors=server_interceptors(config.tracing),
        auth=authenticator,
    )
    log.info(
        "training %s%s (step %d, version %d, %s compute over fp32 weights, %d rank(s)) on %s:%d; pushing %s to %s",
        model_name,
        "" if trainer.lora is None else f" with {trainer.lora.summary()}",
        trainer.step,
        trainer.policy_version,
        config.grpo.precision,
        rank_env.world_size,
        config.server.host,
        running.port,
        str(trainer.push_dtype).removeprefix("torch."),
        config.policy_targets or "no policy server",
    )
    return running


def main(config: str | None, overrides: list[str]) -> None:
    try:
        settings = load_learner_config(config, overrides)
        authenticator = settings.auth.load()  # a missing token fails now, not after the model loads
    except ConfigError as error:
        print(f"sciproto serve learner: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        asyncio.run(serve(settings, authenticator))
    except ConfigError as error:  # found once the policy servers answered (push_dtype auto)
        print(f"sciproto serve learner: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except (LeaderGone, RanksFailed) as error:  # a learner rank other than 0
        print(f"sciproto serve learner: {error}", file=sys.stderr)
        raise SystemExit(1) from None
