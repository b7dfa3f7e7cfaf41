"""Bearer-token authentication with roles, checked by a server interceptor
before any handler runs.

A server with authentication on knows a list of tokens; each token belongs to
a named principal, holds one or more roles and has its own limits. Every
method requires one role (`METHOD_ROLES`, the single table of who may call
what). The principal of the current call is available to handlers through
`current_principal()`, so that an environment server can count live episodes
per principal (`claim_episode()`).

Tokens are read from files or environment variables, compared in constant
time against every configured token, and never logged: logs name the
principal only.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from collections.abc import AsyncIterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import yaml
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from sciproto import pb
from sciproto.config import ConfigError
from sciproto.errors import (
    PermissionDenied,
    Reason,
    ResourceExhausted,
    SciprotoError,
    Unauthenticated,
)
from sciproto.interceptors import AroundInterceptor
from sciproto.limits import EpisodeClaim, LiveEpisodeQuota, PrincipalLimits, TokenBucket, bucket_for
from sciproto.token_store import TokenSource, TokenStore

log = logging.getLogger("sciproto.auth")


class AuthRole(enum.StrEnum):
    """What a token may do. One token may hold several roles."""

    AGENT = "agent"  # play episodes and sample the policy (a rollout client)
    GRADER = "grader"  # grade episodes and trajectories
    TRAINER = "trainer"  # train, checkpoint, and push weights to policy servers
    OBSERVER = "observer"  # read-only: Describe, health, reflection


def _service_methods(service: str, roles: dict[str, AuthRole]) -> dict[str, AuthRole]:
    return {f"/{service}/{name}": role for name, role in roles.items()}


def _all_methods(descriptor: object, role: AuthRole) -> dict[str, AuthRole]:
    return {f"/{descriptor.full_name}/{m.name}": role for m in descriptor.methods}  # type: ignore[attr-defined]


_HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"]
_REFLECTION = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]

# The one table of who may call what: full gRPC method name -> required role.
# A method missing here is refused to every token, so a new RPC cannot be
# exposed by accident; tests check that every sciproto RPC is listed.
METHOD_ROLES: dict[str, AuthRole] = {
    **_service_methods(pb.ENV_SERVICE, {
        "Describe": AuthRole.OBSERVER,
        "Reset": AuthRole.AGENT,
        "Step": AuthRole.AGENT,
        "Close": AuthRole.AGENT,
        "Fork": AuthRole.AGENT,
        # Verify operations inside a Session also need GRADER: the env server
        # checks that with require_role(AuthRole.GRADER).
        "Session": AuthRole.AGENT,
        "Verify": AuthRole.GRADER,
        "Reference": AuthRole.GRADER,  # it reveals the answer
    }),
    **_service_methods(pb.POLICY_SERVICE, {
        "Describe": AuthRole.OBSERVER,
        "Generate": AuthRole.AGENT,
        "UpdateWeights": AuthRole.TRAINER,
        "Hold": AuthRole.TRAINER,  # it stops everyone's generation
    }),
    **_service_methods(pb.LEARNER_SERVICE, {
        "Describe": AuthRole.OBSERVER,
        "TrainStep": AuthRole.TRAINER,
        "SaveCheckpoint": AuthRole.TRAINER,
    }),
    **_all_methods(_HEALTH, AuthRole.OBSERVER),
    **_all_methods(_REFLECTION, AuthRole.OBSERVER),
}
HEALTH_METHODS = frozenset(_all_methods(_HEALTH, AuthRole.OBSERVER))


def roles_for_service(service: str) -> list[str]:
    """The roles that the methods of `service` require, sorted."""
    prefix = f"/{service}/"
    return sorted({role.value for method, role in METHOD_ROLES.items() if method.startswith(prefix)})


class TokenEntry(BaseModel):
    """One principal's credential (a bearer token from a file or an environment variable, or a
    client certificate), its roles and its limits."""

    model_config = ConfigDict(extra="forbid")

    principal: str = Field(..., min_length=1, description="Name used in logs, limits and errors")
    roles: list[AuthRole] = Field(..., min_length=1, description="agent, grader, trainer and/or observer")
    token_file: Path | None = Field(None, description="File holding the token, or several, one per line "
                                    "(during a rotation); re-read when it changes")
    token_env: str | None = Field(None, description="Environment variable holding the token")
    client_cert_name: str | None = Field(
        None, min_length=1, description="Common name or DNS name of a client certificate, verified against "
        "server.tls.client_ca under mutual TLS, that identifies this principal when the call carries no token")
    limits: PrincipalLimits = Field(default_factory=PrincipalLimits, description="Unset fields come from default_limits")

    @model_validator(mode="before")
    @classmethod
    def _no_literal_token(cls, data: object) -> object:
        if isinstance(data, dict) and {"token", "value", "secret"} & data.keys():
            raise ValueError("tokens may not be written in the config: put the token in a file "
                             "(token_file: PATH) or an environment variable (token_env: NAME)")
        return data

    @model_validator(mode="after")
    def _one_source(self) -> TokenEntry:
        given = [name for name in ("token_file", "token_env", "client_cert_name") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"credential of {self.principal!r}: give exactly one of token_file, token_env or "
                             f"client_cert_name (got {', '.join(given) or 'none'})")
        return self


class AuthSettings(BaseModel):
    """The content of an auth file (or of inline `auth` settings)."""

    model_config = ConfigDict(extra="forbid")

    tokens: list[TokenEntry] = Field(default_factory=list)
    health_open: bool = Field(True, description="Health checks need no token (load balancers probe them)")
    default_limits: PrincipalLimits = Field(default_factory=PrincipalLimits, description="Limits of tokens that set none")
    token_file_check_s: float = Field(1.0, gt=0, description="How often token files are checked for changes "
                                      "(rotation and revocation take effect without a restart)")

    @field_validator("tokens")
    @classmethod
    def _unique_principals(cls, tokens: list[TokenEntry]) -> list[TokenEntry]:
        names = [t.principal for t in tokens]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise ValueError(f"principal names must be unique; repeated: {', '.join(duplicated)}")
        return tokens


class AuthConfig(AuthSettings):
    """The `auth` section of every component config. Authentication is on
    when `file` is set (`sciproto serve ... --auth FILE`) or tokens are
    listed inline; off otherwise. A file holds the same keys as the inline
    settings, and its relative token_file paths start from the file's folder."""

    file: Path | None = Field(None, description="YAML auth file; replaces inline settings")

    @property
    def enabled(self) -> bool:
        return self.file is not None or bool(self.tokens)

    @model_validator(mode="after")
    def _file_or_inline(self) -> AuthConfig:
        inline = sorted(self.model_fields_set - {"file"})
        if self.file is not None and inline:
            raise ValueError(f"auth.file ({self.file}) and inline auth settings ({', '.join(inline)}) are both "
                             "given: move the inline settings into the file")
        return self

    @model_serializer(mode="wrap")
    def _file_alone(self, serialize: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A saved config (sciproto train hands one to each child process) must load again:
        # with a file, the inline defaults would read as settings given beside it.
        data: dict[str, Any] = serialize(self)
        return {"file": data["file"]} if self.file is not None else data

    def settings(self) -> AuthSettings:
        """The settings in force: the file's, or the inline ones."""
        if self.file is None:
            return AuthSettings(**{name: getattr(self, name) for name in AuthSettings.model_fields})
        return load_auth_file(self.file)

    def load(self) -> Authenticator | None:
        """The authenticator with every token read, or None when auth is off.
        Call it early to fail fast on a missing token file or variable."""
        return Authenticator(self.settings()) if self.enabled else None


def load_auth_file(path: Path) -> AuthSettings:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as error:
        raise ConfigError(f"auth file {path}: {error.strerror}") from error
    if not isinstance(data, dict):
        raise ConfigError(f"auth file {path}: top level must be a mapping with a `tokens` list")
    try:
        settings = AuthSettings.model_validate(data)
    except ValidationError as error:
        raise ConfigError(f"invalid auth file {path}:\n{error}") from error
    if not settings.tokens:
        raise ConfigError(f"auth file {path} lists no tokens, so every call would be refused: add tokens "
                          "or serve without --auth")
    for entry in settings.tokens:
        if entry.token_file is not None and not entry.token_file.is_absolute():
            entry.token_file = path.parent / entry.token_file
    return settings


@dataclass(eq=False)
class Principal:
    """Who a token belongs to, what it may do, and its usage counters. One
    object per token for the server's lifetime, shared by all its calls."""

    name: str
    roles: frozenset[AuthRole]
    limits: PrincipalLimits
    rate: TokenBucket | None
    episodes: LiveEpisodeQuota

    def has_role(self, role: AuthRole) -> bool:
        return role in self.roles

    def claim_episode(self, retry_after_s: float = 1.0) -> EpisodeClaim:
        """Count a new live episode against `limits.max_live_episodes`
        (RESOURCE_EXHAUSTED, TOO_MANY_EPISODES beyond it)."""
        return self.episodes.claim(retry_after_s)


def bearer_token(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    """The token of an `authorization: Bearer <token>` header, if any."""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


class Authenticator:
    """Maps a call's metadata to its principal and checks role and rate."""

    def __init__(self, settings: AuthSettings) -> None:
        self.health_open = settings.health_open
        sources = []
        self._by_certificate: dict[str, Principal] = {}
        for entry in settings.tokens:
            limits = entry.limits.over(settings.default_limits)
            principal = Principal(entry.principal, frozenset(entry.roles), limits, bucket_for(limits),
                                  LiveEpisodeQuota(entry.principal, limits.max_live_episodes))
            if entry.client_cert_name is not None:
                if entry.client_cert_name in self._by_certificate:
                    raise ConfigError(f"auth: client_cert_name {entry.client_cert_name!r} is given to two "
                                      "principals; give each its own certificate")
                self._by_certificate[entry.client_cert_name] = principal
            else:
                sources.append(TokenSource(principal, entry.principal, entry.token_file, entry.token_env))
        self._tokens = TokenStore(sources, settings.token_file_check_s)

    @property
    def principals(self) -> list[Principal]:
        return [*self._tokens.owners(), *self._by_certificate.values()]

    @property
    def needs_client_certificates(self) -> bool:
        """Some principals are known by their client certificate (only mutual TLS verifies one)."""
        return bool(self._by_certificate)

    def identify(self, metadata: Sequence[tuple[str, str | bytes]] | None,
                 certificate_names: Sequence[str] = ()) -> Principal:
        """The principal whose token the call carries; without a token, the one its verified client
        certificate names; otherwise UNAUTHENTICATED."""
        token = bearer_token(metadata)
        if token is None:
            for name in certificate_names:
                if name in self._by_certificate:
                    return self._by_certificate[name]
            if certificate_names and self._by_certificate:
                raise Unauthenticated(
                    f"the client certificate ({', '.join(certificate_names)}) is not one this server's auth file "
                    "names (client_cert_name), and the call carries no bearer token",
                    Reason.UNAUTHENTICATED, metadata={"cause": "unknown_certificate"})
            raise Unauthenticated(
                "this server requires a bearer token: send metadata `authorization: Bearer <token>` "
                "(ChannelConfig token / token_file / token_env, or `sciproto describe --token`)",
                Reason.UNAUTHENTICATED, metadata={"cause": "missing_token"},
            )
        found = self._tokens.lookup(token)
        if found is None:
            raise Unauthenticated("the bearer token is not one this server accepts: check which token "
                                  "the server's auth file lists for you", Reason.UNAUTHENTICATED,
                                  metadata={"cause": "unknown_token"})
        return found

    def authorize(self, method: str, metadata: Sequence[tuple[str, str | bytes]] | None,
                  certificate_names: Sequence[str] = ()) -> Principal | None:
        """The caller's principal if it may call `method` now; None for an
        open health check; otherwise raises UNAUTHENTICATED,
        PERMISSION_DENIED or RESOURCE_EXHAUSTED (RATE_LIMITED)."""
        if self.health_open and method in HEALTH_METHODS:
            return None
        principal = self.identify(metadata, certificate_names)
        role = METHOD_ROLES.get(method)
        if role is None:
            raise PermissionDenied(f"{method} is not in sciproto.auth.METHOD_ROLES, so no token may call it",
                                   Reason.PERMISSION_DENIED, metadata={"principal": principal.name, "method": method})
        if not principal.has_role(role):
            held = ", ".join(sorted(principal.roles))
            raise PermissionDenied(
                f"{method} requires role {role.value!r}; principal {principal.name!r} holds {held}",
                Reason.PERMISSION_DENIED,
                metadata={"principal": principal.name, "method": method, "required_role": role.value},
            )
        charge_request(principal)
        return principal


def charge_request(principal: Principal | None) -> None:
    """Count one request against `principal`'s rate (a call, or one operation of a stream);
    RESOURCE_EXHAUSTED (RATE_LIMITED, with RetryInfo) when it is over. None: auth is off."""
    if principal is None or principal.rate is None:
        return
    wait_s = principal.rate.try_take()
    if wait_s > 0:
        raise ResourceExhausted(
            f"principal {principal.name!r} is over its rate of {principal.limits.requests_per_second:g} "
            f"calls/s (burst {principal.rate.burst}); retry after the delay in RetryInfo",
            Reason.RATE_LIMITED, metadata={"principal": principal.name}, retry_after_s=wait_s,
        )


_current_principal: ContextVar[Principal | None] = ContextVar("sciproto_principal", default=None)


def current_principal() -> Principal | None:
    """The principal of the call being handled; None when auth is off."""
    return _current_principal.get()


def require_role(role: AuthRole) -> None:
    """PERMISSION_DENIED unless the current caller holds `role` (a no-op
    when auth is off). For operations nested in a stream, like a Verify
    inside an EnvironmentService Session."""
    principal = current_principal()
    if principal is not None and not principal.has_role(role):
        raise PermissionDenied(f"this operation requires role {role.value!r}; principal {principal.name!r} "
                               f"holds {', '.join(sorted(principal.roles))}", Reason.PERMISSION_DENIED,
                               metadata={"principal": principal.name, "required_role": role.value})


def claim_episode(retry_after_s: float = 1.0) -> EpisodeClaim:
    """Count a new episode against the current principal's live-episode
    quota; a claim that counts nothing when auth is off."""
    principal = current_principal()
    return principal.claim_episode(retry_after_s) if principal is not None else EpisodeClaim(None)


def verified_certificate_names(context: grpc.aio.ServicerContext) -> list[str]:
    """Common name and subject alternative names of the caller's client certificate. gRPC fills
    them in only for a certificate it verified (mutual TLS against server.tls.client_ca)."""
    properties = context.auth_context()
    return [value.decode(errors="replace") for key in ("x509_common_name", "x509_subject_alternative_name")
            for value in properties.get(key, [])]


class AuthInterceptor(AroundInterceptor):
    """Refuses a call before its handler runs unless its token holds the
    method's role and its principal is within its rate."""

    def __init__(self, authenticator: Authenticator) -> None:
        self.authenticator = authenticator

    @contextlib.asynccontextmanager
    async def around(self, method: str, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        try:
            # Certificate names only matter where principals are known by them; reading the
            # auth context on every call of every other server would be work for nothing.
            names = verified_certificate_names(context) if self.authenticator.needs_client_certificates else ()
            principal = self.authenticator.authorize(method, context.invocation_metadata(), names)
        except SciprotoError as error:
            who = error.metadata.get("principal", "an unauthenticated caller")
            log.info("refused %s from %s (%s): %s", method, who, context.peer(), error.reason)
            raise
        if principal is not None:
            log.debug("%s called by %s", method, principal.name)
        # Every RPC runs in its own asyncio task, with its own copy of the
        # context, so this value is seen by this call's handler only.
        _current_principal.set(principal)
        yield
