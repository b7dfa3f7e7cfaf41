"""Server bootstrap shared by every sciproto component: a grpc.aio server
with health checking, reflection, interceptors, TLS, bearer-token auth,
message-size limits, keepalive, and graceful shutdown that drains in-flight
calls on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from pydantic import BaseModel, Field, model_validator

from sciproto.auth import AuthConfig, Authenticator, AuthInterceptor, roles_for_service
from sciproto.config import ConfigError
from sciproto.interceptors import ErrorInterceptor, LoggingInterceptor
from sciproto.pb import common_pb2
from sciproto.tls import TlsServerConfig, is_loopback
from sciproto.units import MiB
from sciproto.version import PROTOCOL_VERSION, __version__

log = logging.getLogger("sciproto.server")


class ServerConfig(BaseModel):
    """Network settings of one server process."""

    host: str = Field("127.0.0.1", description="Interface to bind; loopback unless asked otherwise")
    port: int = Field(0, ge=0, le=65535, description="0 picks a free port")
    max_receive_message_bytes: int = Field(
        64 * MiB, gt=0, description="Largest message a client may send (larger: RESOURCE_EXHAUSTED)")
    max_send_message_bytes: int = Field(64 * MiB, gt=0, description="Largest message the server sends")
    keepalive_time_s: float = Field(30.0, gt=0, description="Ping an idle connection this often")
    keepalive_timeout_s: float = Field(10.0, gt=0, description="Drop a connection whose ping goes unanswered")
    grace_period_s: float = Field(10.0, ge=0, description="How long shutdown waits for in-flight calls")
    tls: TlsServerConfig | None = Field(None, description="None: plaintext, allowed on loopback only by default")
    allow_insecure_remote: bool = Field(False, description="Serve plaintext on a non-loopback host (trusted networks only)")

    @model_validator(mode="after")
    def _plaintext_only_on_loopback(self) -> ServerConfig:
        if self.tls is None and not self.allow_insecure_remote and not is_loopback(self.host):
            raise ValueError(
                f"refusing to serve plaintext on {self.host!r}, which other machines can reach: set "
                "server.tls (cert and key), or, on a trusted network only, server.allow_insecure_remote=true"
            )
        return self

    def grpc_options(self) -> list[tuple[str, Any]]:
        return [
            ("grpc.max_receive_message_length", self.max_receive_message_bytes),
            ("grpc.max_send_message_length", self.max_send_message_bytes),
            ("grpc.keepalive_time_ms", int(self.keepalive_time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 5000),
            ("grpc.so_reuseport", 0),
        ]

    def message_limits(self) -> common_pb2.MessageLimits:
        return common_pb2.MessageLimits(
            max_receive_message_bytes=self.max_receive_message_bytes,
            max_send_message_bytes=self.max_send_message_bytes,
        )


@dataclass(frozen=True)
class Service:
    """A servicer and the generated function that registers it."""

    name: str  # full service name, e.g. "sciproto.v1.EnvironmentService"
    servicer: Any
    register: Callable[[Any, grpc.aio.Server], None]


class RunningServer:
    """A started server: its bound port, health state and shutdown."""

    def __init__(self, server: grpc.aio.Server, port: int, health_servicer: health.aio.HealthServicer,
                 services: Sequence[Service], grace_period_s: float) -> None:
        self.server = server
        self.port = port
        self.health = health_servicer
        self.services = services
        self.grace_period_s = grace_period_s
        self._stopping: asyncio.Task[None] | None = None

    async def _set_health(self, status: int) -> None:
        for name in ["", *(s.name for s in self.services)]:
            await self.health.set(name, status)

    async def stop(self) -> None:
        """Refuse new calls, let in-flight ones finish within the grace period."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop())
        await asyncio.shield(self._stopping)

    async def _stop(self) -> None:
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        for service in self.services:
            # New calls are refused by the server from here on; a service with long-lived
            # streams (which run on through the grace period) stops taking new work on them.
            drain = getattr(service.servicer, "drain", None)
            if drain is not None:
                drain()
        log.info("draining in-flight calls (grace %.1f s)", self.grace_period_s)
        await self.server.stop(self.grace_period_s)
        for service in self.services:
            close = getattr(service.servicer, "aclose", None)
            if close is not None:
                await close()

    async def wait(self) -> None:
        await self.server.wait_for_termination()


async def start_server(
    config: ServerConfig,
    services: Sequence[Service],
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    credentials: grpc.ServerCredentials | None = None,
    auth: AuthConfig | Authenticator | None = None,
) -> RunningServer:
    """Start serving `services`, with health and reflection, and return at once.

    TLS comes from `config.tls` (`credentials`, when given, take its place).
    With `auth` enabled, every call needs a bearer token holding the method's
    role (see sciproto.auth.METHOD_ROLES); pass `auth_config.load()` instead
    of the config to read the tokens early, before slow start-up work.

    Interceptor order: `interceptors` (tracing) outermost, so an RPC span sees
    the final status of the call; then logging, errors, auth, so errors raised
    by any of them get a proper status and nothing after auth runs for a
    refused call.
    """
    authenticator = auth.load() if isinstance(auth, AuthConfig) else auth
    if authenticator is not None and authenticator.needs_client_certificates and not (
            config.tls is not None and config.tls.require_client_cert):
        raise ConfigError("the auth settings name principals by client certificate (client_cert_name), which only "
                          "mutual TLS verifies: set server.tls.client_ca and server.tls.require_client_cert: true")
    if credentials is None and config.tls is not None:
        credentials = config.tls.credentials()
    security = [AuthInterceptor(authenticator)] if authenticator is not None else []
    server = grpc.aio.server(
        interceptors=[*interceptors, LoggingInterceptor(), ErrorInterceptor(), *security],
        options=config.grpc_options(),
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for service in services:
        service.register(service.servicer, server)
    names = [s.name for s in services]
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    address = f"{config.host}:{config.port}"
    _check_bindable(config.host, config.port)
    try:
        port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as error:  # grpc's "Failed to bind to address ..."
        raise OSError(f"cannot listen on {address} ({error}); {_PORT_HINT}") from None
    if port == 0:
        raise OSError(f"cannot listen on {address}; {_PORT_HINT}")
    await server.start()
    transport = "plaintext" if credentials is None else "mutual TLS" if config.tls and config.tls.require_client_cert else "TLS"
    principals = ", ".join(p.name for p in authenticator.principals) if authenticator else None
    log.info("listening on %s:%d (%s; %s)", config.host, port, transport,
             f"auth on for {principals}" if principals else "auth off")
    running = RunningServer(server, port, health_servicer, services, config.grace_period_s)
    await running._set_health(health_pb2.HealthCheckResponse.SERVING)
    return running


_PORT_HINT = "is another server using the port? Pick another with --port N, or --port 0 for any free one"


def _check_bindable(host: str, port: int) -> None:
    """Fail with a one-line OSError when `host:port` cannot be bound (in use, or not an address
    of this machine), before grpc tries and logs a C++ error line of its own."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise OSError(f"cannot listen on {host}:{port}: {host!r} is not a known host name ({error.strerror})") from None
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as grpc binds
        try:
            probe.bind(sockaddr)
        except OSError as error:
            hint = _PORT_HINT if error.errno == errno.EADDRINUSE else "is that an address of this machine?"
            raise OSError(f"cannot listen on {host}:{port} ({error.strerror}); {hint}") from None


async def serve_until_signalled(running: RunningServer, on_ready: Callable[[int], None] | None = None) -> None:
    """Block until SIGTERM or SIGINT, then shut down gracefully."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if on_ready is not None:
        on_ready(running.port)
    await stop.wait()
    log.info("signal received; shutting down")
    await running.stop()


def server_info(
    config: ServerConfig,
    implementation: str,
    capabilities: Sequence[str] = (),
    *,
    service: str,
    auth: AuthConfig | None = None,
) -> common_pb2.ServerInfo:
    """The ServerInfo every Describe returns: versions, capabilities, the
    message limits of `config`, and the roles the methods of `service`
    (e.g. pb.ENV_SERVICE) require when `auth` is enabled."""
    return common_pb2.ServerInfo(
        protocol_version=PROTOCOL_VERSION,
        server_version=__version__,
        implementation=implementation,
        capabilities=list(capabilities),
        limits=config.message_limits(),
        auth_roles=roles_for_service(service) if auth is not None and auth.enabled else [],
    )


def announce_port(component: str, port: int) -> None:
    """Print the bound port on a line of its own, so that scripts and tests
    that started the server with port 0 can read where it listens."""
    print(f"SCIPROTO_READY {component} port={port}", flush=True)
