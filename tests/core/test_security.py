"""TLS, mutual TLS, bearer tokens with roles and per-principal limits, against
real probe server processes with throwaway certificates."""

from __future__ import annotations

import asyncio
import collections
import json
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.train import TrainConfig
from sciproto import pb
from sciproto.auth import (
    METHOD_ROLES,
    AuthConfig,
    Authenticator,
    AuthRole,
    AuthSettings,
    TokenEntry,
    roles_for_service,
)
from sciproto.channel import ChannelConfig, TlsClientConfig, make_channel
from sciproto.config import ConfigError, load_config
from sciproto.describe import list_services
from sciproto.errors import (
    PermissionDenied,
    Reason,
    ResourceExhausted,
    SciprotoError,
    Unauthenticated,
    from_rpc_error,
)
from sciproto.limits import PrincipalLimits, TokenBucket
from sciproto.processes import ServerProcess, ServerStartError, sciproto_command, start_command
from sciproto.server import ServerConfig

from .certs import CertAndKey, issue, make_ca

PROBE = Path(__file__).with_name("probe_server.py")
ROLLOUT_TOKEN_ENV = "PROBE_ROLLOUT_TOKEN"
REFUSED_STREAM_TRIES = 400


@dataclass(frozen=True)
class Pki:
    ca: CertAndKey
    other_ca: CertAndKey
    server: CertAndKey
    client: CertAndKey
    rogue_client: CertAndKey  # signed by other_ca


@dataclass(frozen=True)
class Secured:
    """A TLS server with auth on, its tokens by principal, and its log file."""

    server: ServerProcess
    tokens: dict[str, str]
    log: Path


def start_probe(*overrides: str, env: dict[str, str] | None = None, log_file: Path | None = None) -> ServerProcess:
    command = [sys.executable, str(PROBE), "--verbose"]
    for override in overrides:
        command += ["--set", override]
    return start_command(command, timeout_s=60, env=env, log_file=log_file)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    ca, other_ca = make_ca(directory, "ca"), make_ca(directory, "other-ca")
    return Pki(ca, other_ca, issue(ca, directory, "server"), issue(ca, directory, "client", client=True),
               issue(other_ca, directory, "rogue-client", client=True))


@pytest.fixture(scope="module")
def secured(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    directory = tmp_path_factory.mktemp("auth")
    tokens = {name: secrets.token_urlsafe(32) for name in ("rollout", "grader", "watcher", "limited", "quota")}
    for name in ("grader", "watcher", "limited", "quota"):
        (directory / f"{name}.token").write_text(tokens[name] + "\n")
    # Relative token_file paths start from the auth file's folder.
    (directory / "auth.yaml").write_text(f"""
tokens:
  - principal: rollout
    roles: [agent, observer]
    token_env: {ROLLOUT_TOKEN_ENV}
  - principal: grader
    roles: [grader]
    token_file: grader.token
  - principal: watcher
    roles: [observer]
    token_file: watcher.token
  - principal: limited
    roles: [agent]
    token_file: limited.token
    limits: {{requests_per_second: 0.001, burst: 2}}
  - principal: quota
    roles: [agent]
    token_file: quota.token
    limits: {{max_live_episodes: 2}}
""")
    log = directory / "server.log"
    server = start_probe(f"server.tls.cert={pki.server.cert}", f"server.tls.key={pki.server.key}",
                         f"auth.file={directory / 'auth.yaml'}", env={ROLLOUT_TOKEN_ENV: tokens["rollout"]},
                         log_file=log)
    yield Secured(server, tokens, log)
    server.stop()


def tls_channel(target: str, ca: CertAndKey, token: str | None = None, client: CertAndKey | None = None) -> grpc.aio.Channel:
    tls = TlsClientConfig(ca_cert=ca.cert, client_cert=client.cert if client else None,
                          client_key=client.key if client else None)
    return make_channel(ChannelConfig(target=target, tls=tls, token=token, max_attempts=1, default_timeout_s=10))


async def step(channel: grpc.aio.Channel, episode_id: str) -> pb.env_pb2.StepResponse:
    return await pb.env_grpc.EnvironmentServiceStub(channel).Step(pb.env_pb2.StepRequest(episode_id=episode_id))


async def health(channel: grpc.aio.Channel) -> int:
    response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    return response.status


async def refusal(call) -> SciprotoError:
    """The typed error of a call that must fail."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return from_rpc_error(caught.value)


# --- TLS ---------------------------------------------------------------------


async def test_tls_call_with_the_right_ca_reports_limits_and_roles(secured: Secured, pki: Pki) -> None:
    async with tls_channel(secured.server.target, pki.ca, secured.tokens["watcher"]) as channel:
        stub = pb.env_grpc.EnvironmentServiceStub(channel)
        described = await stub.Describe(pb.env_pb2.EnvironmentServiceDescribeRequest())
    assert list(described.server.auth_roles) == ["agent", "grader", "observer"]
    assert described.server.limits.max_receive_message_bytes == 1024 * 1024
    assert described.server.implementation == "probe"


async def test_tls_fails_with_the_wrong_ca(secured: Secured, pki: Pki) -> None:
    async with tls_channel(secured.server.target, pki.other_ca) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await health(channel)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_plaintext_client_cannot_talk_to_a_tls_server(secured: Secured) -> None:
    async with make_channel(ChannelConfig(target=secured.server.target, max_attempts=1, default_timeout_s=10)) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await health(channel)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.fixture(scope="module")
def mutual(pki: Pki) -> Iterator[ServerProcess]:
    # Bound to every interface: TLS makes a remote bind acceptable without allow_insecure_remote.
    server = start_probe("server.host=0.0.0.0", f"server.tls.cert={pki.server.cert}",
                         f"server.tls.key={pki.server.key}", f"server.tls.client_ca={pki.ca.cert}",
                         "server.tls.require_client_cert=true")
    yield server
    server.stop()


async def test_mutual_tls_accepts_a_client_certificate_from_its_ca(mutual: ServerProcess, pki: Pki) -> None:
    async with tls_channel(mutual.target, pki.ca, client=pki.client) as channel:
        assert await health(channel) == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("who", ["no certificate", "certificate from another CA"])
async def test_mutual_tls_refuses_other_clients(mutual: ServerProcess, pki: Pki, who: str) -> None:
    client = None if who == "no certificate" else pki.rogue_client
    async with tls_channel(mutual.target, pki.ca, client=client) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await health(channel)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert mutual.alive()


@pytest.fixture(scope="module")
def mutual_with_principals(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Mutual TLS where the certificate named "client" is principal lab-b, and a token principal too."""
    directory = tmp_path_factory.mktemp("cert-auth")
    (directory / "watcher.token").write_text(secrets.token_urlsafe(32) + "\n")
    (directory / "auth.yaml").write_text("""
tokens:
  - {principal: lab-b, roles: [agent, observer], client_cert_name: client}
  - {principal: watcher, roles: [observer], token_file: watcher.token}
""")
    server = start_probe(f"server.tls.cert={pki.server.cert}", f"server.tls.key={pki.server.key}",
                         f"server.tls.client_ca={pki.ca.cert}", "server.tls.require_client_cert=true",
                         f"auth.file={directory / 'auth.yaml'}")
    yield server
    server.stop()


async def test_a_client_certificate_named_in_the_auth_file_is_its_principal(
    mutual_with_principals: ServerProcess, pki: Pki, tmp_path: Path,
) -> None:
    async with tls_channel(mutual_with_principals.target, pki.ca, client=pki.client) as channel:
        answer = await step(channel, "whoami")  # no token: the certificate says who calls
    assert answer.info["principal"] == "lab-b"
    unlisted = issue(pki.ca, tmp_path, "unlisted-client", client=True)  # valid, but named nowhere
    async with tls_channel(mutual_with_principals.target, pki.ca, client=unlisted) as channel:
        refused = await refusal(step(channel, "whoami"))
    assert isinstance(refused, Unauthenticated) and "unlisted-client" in refused.message
    assert mutual_with_principals.alive()


def test_certificate_principals_need_mutual_tls(pki: Pki, tmp_path: Path) -> None:
    (tmp_path / "auth.yaml").write_text("tokens:\n  - {principal: lab-b, roles: [agent], client_cert_name: client}\n")
    with pytest.raises(ServerStartError, match="require_client_cert"):
        start_probe(f"server.tls.cert={pki.server.cert}", f"server.tls.key={pki.server.key}",
                    f"auth.file={tmp_path / 'auth.yaml'}")
    with pytest.raises(ConfigError, match="exactly one of token_file, token_env or client_cert_name"):
        load_config(AuthConfig, None, ["tokens=[{principal: a, roles: [agent], client_cert_name: c, token_env: T}]"])


def test_plaintext_on_a_remote_interface_needs_explicit_consent() -> None:
    with pytest.raises(ServerStartError, match="allow_insecure_remote"):
        start_probe("server.host=0.0.0.0")
    allowed = start_probe("server.host=0.0.0.0", "server.allow_insecure_remote=true")
    try:
        assert allowed.alive()
    finally:
        allowed.stop()


# --- tokens and roles --------------------------------------------------------


async def test_missing_and_unknown_tokens_are_unauthenticated(secured: Secured, pki: Pki) -> None:
    async with tls_channel(secured.server.target, pki.ca) as channel:
        missing = await refusal(step(channel, "whoami"))
    async with tls_channel(secured.server.target, pki.ca, secrets.token_urlsafe(32)) as channel:
        unknown = await refusal(step(channel, "whoami"))
    for error, cause in ((missing, "missing_token"), (unknown, "unknown_token")):
        assert isinstance(error, Unauthenticated)
        assert error.reason == Reason.UNAUTHENTICATED and error.metadata["cause"] == cause


async def test_a_token_without_the_role_is_denied_with_the_role_it_needs(secured: Secured, pki: Pki) -> None:
    async with tls_channel(secured.server.target, pki.ca, secured.tokens["grader"]) as channel:
        denied = await refusal(step(channel, "whoami"))
    assert isinstance(denied, PermissionDenied) and denied.reason == Reason.PERMISSION_DENIED
    assert denied.metadata == {"principal": "grader", "required_role": "agent",
                               "method": "/sciproto.v1.EnvironmentService/Step"}


async def test_the_right_role_reaches_the_handler_as_its_principal(secured: Secured, pki: Pki) -> None:
    async with tls_channel(secured.server.target, pki.ca, secured.tokens["rollout"]) as rollout, \
            tls_channel(secured.server.target, pki.ca, secured.tokens["quota"]) as quota:
        answers = [await step(rollout, "whoami"), await step(quota, "whoami"), await step(rollout, "whoami")]
    assert [a.info["principal"] for a in answers] == ["rollout", "quota", "rollout"]


async def test_health_is_open_but_reflection_needs_a_token(secured: Secured, pki: Pki) -> None:
    codes = []
    async with tls_channel(secured.server.target, pki.ca) as channel:
        assert await health(channel) == health_pb2.HealthCheckResponse.SERVING
        # Many tries: a refused streaming call must report the refusal every time,
        # not a client-side INTERNAL when its request write meets the closed stream.
        for _ in range(REFUSED_STREAM_TRIES):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await list_services(channel, timeout_s=10)
            codes.append(caught.value.code())
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * REFUSED_STREAM_TRIES, collections.Counter(codes)
    async with tls_channel(secured.server.target, pki.ca, secured.tokens["watcher"]) as channel:
        assert pb.ENV_SERVICE in await list_services(channel, timeout_s=10)


async def test_token_files_are_re_read_so_tokens_rotate_and_revoke_without_a_restart(pki: Pki, tmp_path: Path) -> None:
    old, new, newest = (secrets.token_urlsafe(32) for _ in range(3))
    server_file, client_file = tmp_path / "watcher.token", tmp_path / "client.token"
    server_file.write_text(old + "\n")
    (tmp_path / "auth.yaml").write_text(
        "token_file_check_s: 0.05\ntokens:\n  - {principal: watcher, roles: [observer], token_file: watcher.token}\n")
    log = tmp_path / "server.log"
    server = start_probe(f"server.tls.cert={pki.server.cert}", f"server.tls.key={pki.server.key}",
                         f"auth.file={tmp_path / 'auth.yaml'}", log_file=log)

    async def accepted(token: str) -> bool:
        async with tls_channel(server.target, pki.ca, token) as channel:
            try:
                await health(channel)  # health is open: Describe needs the token
                await pb.env_grpc.EnvironmentServiceStub(channel).Describe(pb.env_pb2.EnvironmentServiceDescribeRequest())
            except grpc.aio.AioRpcError as error:
                assert error.code() == grpc.StatusCode.UNAUTHENTICATED, error
                return False
            return True

    async def settles(token: str, expected: bool) -> None:
        deadline = time.monotonic() + 10
        while await accepted(token) != expected:
            assert time.monotonic() < deadline, f"token still {'refused' if expected else 'accepted'} after 10 s"
            await asyncio.sleep(0.05)

    try:
        assert await accepted(old) and not await accepted(new)
        server_file.write_text(f"# rotating\n{old}\n{new}\n")  # both valid while clients move over
        await settles(new, True)
        assert await accepted(old)
        server_file.write_text(new + "\n")  # the old token is revoked
        await settles(old, False)
        assert await accepted(new)
        server_file.write_text("too-short\n")  # an invalid file refuses its principal (fail closed)
        await settles(new, False)
        # the server's output reaches the log file through a reader thread: give it a moment
        deadline = time.monotonic() + 10
        while "is refused until its token file is fixed" not in log.read_text() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert "is refused until its token file is fixed" in log.read_text()

        # A client channel with a token_file sends the file's current token.
        server_file.write_text(f"{new}\n")
        client_file.write_text(new + "\n")
        config = ChannelConfig(target=server.target, tls=TlsClientConfig(ca_cert=pki.ca.cert), token_file=client_file,
                               max_attempts=1, default_timeout_s=10)
        async with make_channel(config) as channel:
            stub = pb.env_grpc.EnvironmentServiceStub(channel)
            await settles(new, True)
            await stub.Describe(pb.env_pb2.EnvironmentServiceDescribeRequest())
            server_file.write_text(f"{newest}\n")
            client_file.write_text(newest + "\n")
            await settles(newest, True)
            await asyncio.sleep(1.1)  # the client checks its file at most once a second
            await stub.Describe(pb.env_pb2.EnvironmentServiceDescribeRequest())
        assert server.alive()
        assert old not in log.read_text() and new not in log.read_text()  # tokens are never logged
    finally:
        server.stop()


# --- limits ------------------------------------------------------------------


async def test_rate_limit_answers_resource_exhausted_with_retry_info(secured: Secured, pki: Pki) -> None:
    async with tls_channel(secured.server.target, pki.ca, secured.tokens["limited"]) as channel:
        for _ in range(2):  # the burst
            await step(channel, "whoami")
        limited = await refusal(step(channel, "whoami"))
    assert isinstance(limited, ResourceExhausted) and limited.reason == Reason.RATE_LIMITED
    assert limited.retry_after_s is not None and limited.retry_after_s > 0
    assert limited.metadata["principal"] == "limited"


async def test_live_episode_quota_is_per_principal(secured: Secured, pki: Pki) -> None:
    async with tls_channel(secured.server.target, pki.ca, secured.tokens["quota"]) as quota, \
            tls_channel(secured.server.target, pki.ca, secured.tokens["rollout"]) as unlimited:
        claimed = [(await step(quota, "claim")).step_count for _ in range(2)]
        over = await refusal(step(quota, "claim"))
        for _ in range(3):
            await step(unlimited, "claim")
    assert claimed == [1, 2]
    assert isinstance(over, ResourceExhausted) and over.reason == Reason.TOO_MANY_EPISODES
    assert over.metadata == {"principal": "quota", "max_live_episodes": "2"} and over.retry_after_s == 1.0


# --- logs and CLI ------------------------------------------------------------


async def test_tokens_never_appear_in_the_server_log(secured: Secured, pki: Pki) -> None:
    bad_token = secrets.token_urlsafe(32)
    async with tls_channel(secured.server.target, pki.ca, secured.tokens["grader"]) as channel:
        await refusal(step(channel, "whoami"))
    async with tls_channel(secured.server.target, pki.ca, secured.tokens["rollout"]) as channel:
        await step(channel, "whoami")
    async with tls_channel(secured.server.target, pki.ca, bad_token) as channel:
        await refusal(step(channel, "whoami"))
    deadline = time.monotonic() + 15
    while "from an unauthenticated caller" not in secured.log.read_text() and time.monotonic() < deadline:
        await asyncio.sleep(0.1)  # the log reaches the file through a pipe
    log = secured.log.read_text()
    assert "refused /sciproto.v1.EnvironmentService/Step from grader" in log
    assert "called by rollout" in log and "from an unauthenticated caller" in log
    for token in (*secured.tokens.values(), bad_token):
        assert token not in log


def test_describe_command_with_token_and_ca(secured: Secured, pki: Pki) -> None:
    result = subprocess.run(
        sciproto_command("describe", secured.server.target, "--token", secured.tokens["watcher"],
                         "--ca-cert", str(pki.ca.cert)),
        check=False, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    described = json.loads(result.stdout)
    assert described["health"] == "SERVING"
    assert described[pb.ENV_SERVICE]["server"]["auth_roles"] == ["agent", "grader", "observer"]


# --- configuration, in process -----------------------------------------------


def test_every_sciproto_rpc_has_a_role() -> None:
    for service in (pb.env_pb2, pb.policy_pb2, pb.learner_pb2):
        for descriptor in service.DESCRIPTOR.services_by_name.values():
            for method in descriptor.methods:
                assert f"/{descriptor.full_name}/{method.name}" in METHOD_ROLES
    assert METHOD_ROLES["/sciproto.v1.PolicyService/Generate"] == AuthRole.AGENT
    assert roles_for_service(pb.LEARNER_SERVICE) == ["observer", "trainer"]


def test_tokens_cannot_be_written_in_the_config() -> None:
    with pytest.raises(ConfigError, match="token_file"):
        load_config(AuthConfig, None, ["tokens=[{principal: a, roles: [agent], token: s3cret-s3cret-s3cret}]"])
    with pytest.raises(ConfigError, match="exactly one of token_file, token_env or client_cert_name \\(got none\\)"):
        load_config(AuthConfig, None, ["tokens=[{principal: a, roles: [agent]}]"])


def test_auth_setup_errors_say_what_to_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry = {"principal": "a", "roles": ["agent"], "token_env": "SCIPROTO_TEST_UNSET_TOKEN"}
    monkeypatch.delenv("SCIPROTO_TEST_UNSET_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="SCIPROTO_TEST_UNSET_TOKEN .* is not set"):
        AuthConfig(tokens=[entry]).load()
    monkeypatch.setenv("SCIPROTO_TEST_UNSET_TOKEN", "short")
    with pytest.raises(ConfigError, match="fewer than 16 characters"):
        AuthConfig(tokens=[entry]).load()
    (tmp_path / "auth.yaml").write_text("tokens: []\n")
    with pytest.raises(ConfigError, match="lists no tokens"):
        AuthConfig(file=tmp_path / "auth.yaml").load()
    with pytest.raises(ConfigError, match="both"):
        load_config(AuthConfig, None, [f"file={tmp_path / 'auth.yaml'}", "health_open=false"])
    assert AuthConfig().load() is None


def test_a_config_naming_an_auth_file_saves_and_loads_again(tmp_path: Path) -> None:
    """`sciproto train` saves its resolved config for its child servers; an auth file must survive."""
    path = tmp_path / "auth.yaml"
    config = load_config(TrainConfig, None, [f"env.auth.file={path}", f"learner.auth.file={path}"])
    saved = yaml.safe_dump(config.model_dump(mode="json"))
    again = TrainConfig.model_validate(yaml.safe_load(saved))
    assert again.env.auth.file == again.learner.auth.file == path
    assert yaml.safe_load(saved)["env"]["auth"] == {"file": str(path)}
    inline = AuthConfig(tokens=[TokenEntry(principal="a", roles=[AuthRole.AGENT], token_env="T")], health_open=False)
    assert AuthConfig.model_validate(inline.model_dump(mode="json")) == inline


def test_closed_health_needs_an_observer_token(monkeypatch: pytest.MonkeyPatch) -> None:
    token = secrets.token_urlsafe(32)
    monkeypatch.setenv("SCIPROTO_TEST_TOKEN", token)
    settings = AuthSettings(health_open=False, tokens=[
        TokenEntry(principal="lb", roles=[AuthRole.OBSERVER], token_env="SCIPROTO_TEST_TOKEN")])
    authenticator = Authenticator(settings)
    check = "/grpc.health.v1.Health/Check"
    with pytest.raises(Unauthenticated):
        authenticator.authorize(check, ())
    assert authenticator.authorize(check, (("authorization", f"Bearer {token}"),)).name == "lb"
    with pytest.raises(PermissionDenied, match="METHOD_ROLES"):
        authenticator.authorize("/other.Service/Method", (("authorization", f"Bearer {token}"),))


def test_token_limits_inherit_unset_fields_from_defaults() -> None:
    defaults = PrincipalLimits(requests_per_second=10, burst=20, max_live_episodes=8)
    own = PrincipalLimits(max_live_episodes=2)
    assert own.over(defaults) == PrincipalLimits(requests_per_second=10, burst=20, max_live_episodes=2)


def test_token_bucket_refills_at_its_rate() -> None:
    now = [0.0]
    bucket = TokenBucket(rate=2.0, burst=3, clock=lambda: now[0])
    assert [bucket.try_take() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.try_take() == pytest.approx(0.5)  # (1 - 0 tokens) / 2 per s
    now[0] = 0.25  # half a token back
    assert bucket.try_take() == pytest.approx(0.25)
    now[0] = 10.0  # refilled to the burst, not beyond
    assert [bucket.try_take() for _ in range(4)][-1] > 0


def test_channel_reads_its_token_from_a_file(tmp_path: Path) -> None:
    token = secrets.token_urlsafe(32)
    (tmp_path / "t").write_text(token + "\n")
    assert ChannelConfig(target="x:1", token_file=tmp_path / "t").bearer_token()() == token
    with pytest.raises(ValueError, match="at most one of token"):
        ChannelConfig(target="x:1", token=token, token_file=tmp_path / "t")


def test_plaintext_config_on_a_remote_host_is_refused_at_load() -> None:
    with pytest.raises(ConfigError, match="allow_insecure_remote"):
        load_config(ServerConfig, None, ["host=0.0.0.0"])
    assert load_config(ServerConfig, None, ["host=::1"]).host == "::1"
    assert load_config(ServerConfig, None, ["host=0.0.0.0", "allow_insecure_remote=true"]).allow_insecure_remote


def test_client_ca_and_required_client_certs_go_together(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="require_client_cert"):
        load_config(ServerConfig, None, ["tls.cert=c.pem", "tls.key=k.pem", "tls.client_ca=ca.pem"])
    with pytest.raises(ConfigError, match="client_ca is not set"):
        load_config(ServerConfig, None, ["tls.cert=c.pem", "tls.key=k.pem", "tls.require_client_cert=true"])
