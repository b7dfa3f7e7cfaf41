"""`sciproto serve gateway`: connect to the policy servers, then serve the OpenAI-compatible routes
until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from gateway.limits import DEFAULT_MAX_REQUEST_BYTES
from gateway.service import Gateway
from gateway.sessions import SessionLimits, SessionStore
from sciproto.auth import AuthConfig, Authenticator
from sciproto.channel import ChannelConfig
from sciproto.client.policy import PolicyClient
from sciproto.config import ConfigError
from sciproto.errors import Reason, SciprotoError
from sciproto.server import announce_port

__all__ = ["GatewaySettings", "connect", "main", "main_with", "start"]

log = logging.getLogger("gateway")


@dataclass
class GatewaySettings:
    policies: Sequence[str]
    host: str = "127.0.0.1"
    port: int = 8000
    model_names: Sequence[str] = ()  # extra names the served model answers to
    limits: SessionLimits = field(default_factory=SessionLimits)
    auth_file: Path | None = None
    policy_token_file: Path | None = None  # the gateway's own token for the policy servers
    rollouts_file: Path | None = None
    connect_timeout_s: float = 60.0
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    adapter: str = ""  # the policy servers' LoRA adapter the served model's names route to ("": the base)


async def connect(settings: GatewaySettings, authenticator: Authenticator | None = None) -> Gateway:
    """A Gateway over the policy servers, once each has answered Describe. They must serve one model."""
    clients = [PolicyClient(ChannelConfig(target=target, token_file=settings.policy_token_file))
               for target in settings.policies]
    answers = await asyncio.gather(*(c.describe(timeout_s=settings.connect_timeout_s) for c in clients),
                                   return_exceptions=True)
    for target, answer in zip(settings.policies, answers, strict=True):
        if isinstance(answer, BaseException):
            for client in clients:
                await client.close()
            if not isinstance(answer, SciprotoError):
                raise answer
            if answer.reason == Reason.INCOMPATIBLE_PROTOCOL:
                raise ConfigError(answer.message) from answer
            raise ConfigError(f"the policy server at {target} did not answer Describe ({answer.message}); start it "
                              "(`sciproto serve policy`) or fix --policy") from answer
    described = [answer for answer in answers if not isinstance(answer, BaseException)]
    models = sorted({d.model for d in described})
    if len(models) > 1:
        for client in clients:
            await client.close()
        raise ConfigError(f"the policy servers serve different models ({', '.join(models)}); give one model's")
    names = [models[0], *(name for name in settings.model_names if name != models[0])]
    limits = SessionStore(settings.limits)
    return Gateway(clients, names, min(d.max_context_tokens for d in described), limits, authenticator,
                   settings.rollouts_file, max_request_bytes=settings.max_request_bytes, adapter=settings.adapter)


async def start(gateway: Gateway, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve `gateway` on host:port (0: any free port); returns the runner and the bound port."""
    runner = web.AppRunner(gateway.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = site._server
    bound = server.sockets[0].getsockname()[1] if server is not None and server.sockets else port
    return runner, bound


async def _serve(settings: GatewaySettings, authenticator: Authenticator | None) -> None:
    gateway = await connect(settings, authenticator)
    try:
        runner, port = await start(gateway, settings.host, settings.port)
    except OSError as error:
        for client in gateway.policies:
            await client.close()
        raise ConfigError(f"cannot listen on {settings.host}:{settings.port} ({error.strerror or error}); pick "
                          "another --port (0: any free one)") from error
    log.info("gateway for %s over %d policy server(s) on http://%s:%d/v1", gateway.model_names[0],
             len(gateway.policies), settings.host, port)
    announce_port("gateway", port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        for client in gateway.policies:
            await client.close()


def main(settings: GatewaySettings) -> None:
    try:
        authenticator = AuthConfig(file=settings.auth_file).load() if settings.auth_file else None
        asyncio.run(_serve(settings, authenticator))
    except ConfigError as error:
        print(f"sciproto serve gateway: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def main_with(*, max_sessions: int, idle_ttl_s: float, max_session_tokens: int, max_held_records: int,
              **settings: object) -> None:
    """`main` from the command line's options."""
    limits = SessionLimits(max_sessions=max_sessions, idle_ttl_s=idle_ttl_s, max_tokens=max_session_tokens,
                           max_held_records=max_held_records)
    main(GatewaySettings(limits=limits, **settings))  # type: ignore[arg-type]
