"""Channel factory used by every client: TLS or insecure, default deadlines,
keepalive, message limits and bounded retries.

Retries are done by gRPC itself, from the service config below, and only for
UNAVAILABLE (the server was not reached or went away before answering). That
is safe for every sciproto call because requests carry a `request_id` that
servers use to answer a retry with the first result.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from pydantic import BaseModel, ConfigDict, Field, model_validator

from sciproto.tls import read_pem
from sciproto.token_store import ClientToken
from sciproto.units import MiB


class TlsClientConfig(BaseModel):
    """Server verification and, for mutual TLS, the client's own certificate."""

    ca_cert: Path | None = Field(None, description="PEM bundle that signs the server; None uses the system roots")
    client_cert: Path | None = Field(None, description="PEM certificate for mutual TLS")
    client_key: Path | None = Field(None, description="PEM private key for mutual TLS")
    server_name: str | None = Field(None, description="Override the name checked in the server's certificate")

    @model_validator(mode="after")
    def _cert_with_key(self) -> TlsClientConfig:
        if (self.client_cert is None) != (self.client_key is None):
            raise ValueError("tls.client_cert and tls.client_key go together: give both for mutual TLS, or neither")
        return self

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: Path | None, setting: str) -> bytes | None:
            return read_pem(path, setting) if path else None

        return grpc.ssl_channel_credentials(
            read(self.ca_cert, "tls.ca_cert"), read(self.client_key, "tls.client_key"),
            read(self.client_cert, "tls.client_cert"),
        )


class ChannelConfig(BaseModel):
    """How a client reaches one server."""

    target: str = Field(..., description="HOST:PORT, or any gRPC target URI")
    tls: TlsClientConfig | None = Field(None, description="None: plaintext (loopback and trusted networks only)")
    token: str | None = Field(None, description="Bearer token sent with every call", repr=False)
    token_file: Path | None = Field(None, description="File holding the bearer token (keeps it out of configs)")
    token_env: str | None = Field(None, description="Environment variable holding the bearer token")
    default_timeout_s: float = Field(60.0, gt=0, description="Deadline for unary calls and Generate when the caller sets none")
    max_attempts: int = Field(4, ge=1, le=5, description="Tries per call on UNAVAILABLE (gRPC caps this at 5)")
    initial_backoff_s: float = Field(0.2, gt=0)
    max_backoff_s: float = Field(2.0, gt=0)
    keepalive_time_s: float = Field(30.0, gt=0)
    max_message_bytes: int = Field(64 * MiB, gt=0)

    @model_validator(mode="after")
    def _one_token_source(self) -> ChannelConfig:
        given = [name for name in ("token", "token_file", "token_env") if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one of token, token_file, token_env (got {', '.join(given)})")
        return self

    def bearer_token(self) -> Callable[[], str | None]:
        """What gives the token to send on each call (None: send none). A token file is read now
        (a missing or invalid one fails here) and again whenever it changes."""
        if self.token_file is None and self.token_env is None:
            return lambda: self.token
        return ClientToken(self.token_file, self.token_env, f"channel to {self.target}").current

    def service_config(self) -> str:
        retry = {
            "maxAttempts": self.max_attempts,
            "initialBackoff": f"{self.initial_backoff_s}s",
            "maxBackoff": f"{self.max_backoff_s}s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE"],
        }
        policy: dict[str, Any] = {"name": [{}]}
        if self.max_attempts > 1:
            policy["retryPolicy"] = retry
        return json.dumps({"methodConfig": [policy]})

    def options(self) -> list[tuple[str, Any]]:
        return [
            ("grpc.service_config", self.service_config()),
            ("grpc.enable_retries", 1 if self.max_attempts > 1 else 0),
            ("grpc.keepalive_time_ms", int(self.keepalive_time_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
            *((("grpc.ssl_target_name_override", self.tls.server_name),) if self.tls and self.tls.server_name else ()),
        ]


class _Defaults:
    """Adds the bearer token to every call, and the default deadline to calls
    with a single request (long-lived client streams set their own)."""

    def __init__(self, timeout_s: float, token: Callable[[], str | None]) -> None:
        self.timeout_s = timeout_s
        self.token = token

    def details(self, details: grpc.aio.ClientCallDetails, default_timeout: bool) -> grpc.aio.ClientCallDetails:
        token = self.token()
        auth = (("authorization", f"Bearer {token}"),) if token else ()
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *auth)
        timeout = details.timeout if details.timeout is not None or not default_timeout else self.timeout_s
        return grpc.aio.ClientCallDetails(details.method, timeout, metadata, details.credentials, details.wait_for_ready)


# grpc.aio files each interceptor under the first call kind it implements
# (an if/elif chain), so one object per kind is needed to cover all four.
class _UnaryUnaryDefaults(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, defaults: _Defaults) -> None:
        self.defaults = defaults

    async def intercept_unary_unary(self, continuation: Callable[..., Any], details: grpc.aio.ClientCallDetails, request: Any) -> Any:
        return await continuation(self.defaults.details(details, True), request)


class _UnaryStreamDefaults(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, defaults: _Defaults) -> None:
        self.defaults = defaults

    async def intercept_unary_stream(self, continuation: Callable[..., Any], details: grpc.aio.ClientCallDetails, request: Any) -> Any:
        return await continuation(self.defaults.details(details, True), request)


class _StreamUnaryDefaults(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, defaults: _Defaults) -> None:
        self.defaults = defaults

    async def intercept_stream_unary(self, continuation: Callable[..., Any], details: grpc.aio.ClientCallDetails, request_iterator: Any) -> Any:
        return await continuation(self.defaults.details(details, False), request_iterator)


class _StreamStreamDefaults(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, defaults: _Defaults) -> None:
        self.defaults = defaults

    async def intercept_stream_stream(self, continuation: Callable[..., Any], details: grpc.aio.ClientCallDetails, request_iterator: Any) -> Any:
        return await continuation(self.defaults.details(details, False), request_iterator)


def _default_interceptors(config: ChannelConfig, bare_streams: bool) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors for the call kinds that need one. bare_streams: without a token, calls with
    a request stream need nothing (they take no default deadline), so leave them uncovered,
    sparing every message of theirs grpc.aio's intercepted-stream path (a queue and a task per
    write)."""
    defaults = _Defaults(config.default_timeout_s, config.bearer_token())
    kinds: list[type[grpc.aio.ClientInterceptor]] = [_UnaryUnaryDefaults, _UnaryStreamDefaults]
    has_token = config.token is not None or config.token_file is not None or config.token_env is not None
    if has_token or not bare_streams:
        kinds += [_StreamUnaryDefaults, _StreamStreamDefaults]
    return [kind(defaults) for kind in kinds]  # type: ignore[call-arg]


def make_channel(config: ChannelConfig | str, interceptors: list[grpc.aio.ClientInterceptor] | None = None,
                 *, bare_streams: bool = False) -> grpc.aio.Channel:
    """An asyncio channel to one server, configured as `config` says. bare_streams: calls with a
    request stream go uncovered by the default interceptors when there is no token (the env
    client's shared Session stream, where every message counts)."""
    if isinstance(config, str):
        config = ChannelConfig(target=config)
    all_interceptors = [*_default_interceptors(config, bare_streams), *(interceptors or [])]
    if config.tls is not None:
        return grpc.aio.secure_channel(config.target, config.tls.credentials(), config.options(), interceptors=all_interceptors)
    return grpc.aio.insecure_channel(config.target, config.options(), interceptors=all_interceptors)


class ServerAccess(BaseModel):
    """How the client reaches every replica of one kind of server: bearer token and TLS."""

    model_config = ConfigDict(extra="forbid")

    token_file: Path | None = Field(None, description="File holding the bearer token")
    token_env: str | None = Field(None, description="Environment variable holding the bearer token")
    tls: TlsClientConfig | None = Field(None, description="None: plaintext (loopback and trusted networks only)")

    @model_validator(mode="after")
    def _one_token_source(self) -> ServerAccess:
        if self.token_file is not None and self.token_env is not None:
            raise ValueError("give token_file or token_env, not both")
        return self

    def channel(self, target: str) -> ChannelConfig:
        return ChannelConfig(target=target, token_file=self.token_file, token_env=self.token_env, tls=self.tls)
