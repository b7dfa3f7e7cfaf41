"""`sciproto serve env --auth FILE` on a real server process: tokens and roles, per-principal
episode quotas, and episodes that belong to the principal that opened them."""

from __future__ import annotations

import asyncio
import secrets
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sciproto.channel import ChannelConfig
from sciproto.client.env import EnvClient
from sciproto.errors import NotFound, PermissionDenied, Reason, ResourceExhausted, Unauthenticated
from sciproto.pb import common_pb2
from sciproto.processes import ServerProcess, sciproto_command
from tests.env_servers.conftest import serve_env

TEAM_B_TOKEN_ENV = "ENV_AUTH_TEST_TEAM_B_TOKEN"
QUOTA = 2  # team_a's live episodes

REPLY = common_pb2.ChatMessage(role=common_pb2.ROLE_ASSISTANT, content="42")


@dataclass(frozen=True)
class Served:
    server: ServerProcess
    tokens: dict[str, str]  # principal -> token

    def client(self, principal: str | None) -> EnvClient:
        token = self.tokens[principal] if principal else None
        return EnvClient(ChannelConfig(target=self.server.target, token=token, max_attempts=1))


def write_auth_file(folder: Path, tokens: dict[str, str]) -> Path:
    for name in ("team_a", "watcher"):
        (folder / f"{name}.token").write_text(tokens[name] + "\n")
    path = folder / "auth.yaml"
    path.write_text(f"""
tokens:
  - principal: team_a
    roles: [agent, observer]
    token_file: team_a.token
    limits: {{max_live_episodes: {QUOTA}}}
  - principal: team_b
    roles: [agent, grader]
    token_env: {TEAM_B_TOKEN_ENV}
  - principal: watcher
    roles: [observer]
    token_file: watcher.token
""")
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, monkeypatch_module: pytest.MonkeyPatch) -> Iterator[Served]:
    tokens = {name: secrets.token_urlsafe(32) for name in ("team_a", "team_b", "watcher")}
    auth_file = write_auth_file(tmp_path_factory.mktemp("auth"), tokens)
    monkeypatch_module.setenv(TEAM_B_TOKEN_ENV, tokens["team_b"])  # the server process inherits it
    for server in serve_env("auth", "envs=[toy]", f"auth.file={auth_file}"):
        yield Served(server, tokens)


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as patch:
        yield patch


async def test_agent_token_plays_an_episode(served: Served) -> None:
    async with served.client("team_a") as client:
        reset = await client.reset("toy", split="test", index=0)
        step = await client.step(reset.episode_id, REPLY)
        described = await client.describe()
        assert (await client.close(reset.episode_id)).closed
    assert (step.reward.value, step.terminated) == (1.0, True)
    assert list(described.server.auth_roles) == ["agent", "grader", "observer"]


async def test_no_token_is_unauthenticated(served: Served) -> None:
    async with served.client(None) as client:
        with pytest.raises(Unauthenticated) as refused:
            await client.reset("toy", split="test", index=0)
    assert refused.value.reason == Reason.UNAUTHENTICATED


async def test_observer_may_describe_but_not_reset(served: Served) -> None:
    async with served.client("watcher") as client:
        described = await client.describe()
        with pytest.raises(PermissionDenied) as refused:
            await client.reset("toy", split="test", index=0)
    assert [env.name for env in described.environments] == ["toy"]
    assert "'agent'" in refused.value.message


async def test_verify_needs_the_grader_role_also_inside_a_session(served: Served) -> None:
    async with served.client("team_a") as client:
        reset = await client.reset("toy", split="test", index=1)
        with pytest.raises(PermissionDenied):
            await client.verify(reset.episode_id)
        async with client.session() as session:
            opened = await session.reset("toy", split="test", index=2)
            with pytest.raises(PermissionDenied) as in_band:
                await session.verify(opened.episode_id)
            step = await session.step(opened.episode_id, REPLY)  # the stream goes on
        await client.close(reset.episode_id)
    assert "'grader'" in in_band.value.message and step.terminated
    async with served.client("team_b") as grader, grader.session() as session:
        opened = await session.reset("toy", split="test", index=3)
        early = await session.verify(opened.episode_id)  # toy cannot grade an unfinished episode
        await session.step(opened.episode_id, REPLY)
        verified = await session.verify(opened.episode_id)
    assert early.reward.status == common_pb2.REWARD_STATUS_UNSCORED
    assert "has not terminated yet" in early.reward.detail
    assert verified.reward.status == common_pb2.REWARD_STATUS_SCORED


async def test_live_episode_quota_is_per_principal(served: Served) -> None:
    async with served.client("team_a") as team_a, served.client("team_b") as team_b:
        opened = [await team_a.reset("toy", split="train", index=i) for i in range(QUOTA)]
        with pytest.raises(ResourceExhausted) as over:
            await team_a.reset("toy", split="train", index=QUOTA)
        others = [await team_b.reset("toy", split="train", index=i) for i in range(QUOTA + 1)]
        await team_a.close(opened[0].episode_id)
        reopened = await team_a.reset("toy", split="train", index=0)  # Close gave a place back
        for episode in [*opened[1:], reopened]:
            await team_a.close(episode.episode_id)
        for episode in others:
            await team_b.close(episode.episode_id)
    assert over.value.reason == Reason.TOO_MANY_EPISODES and over.value.retry_after_s > 0
    assert over.value.metadata["principal"] == "team_a"


async def test_a_session_end_gives_the_quota_back(served: Served) -> None:
    async with served.client("team_a") as client:
        async with client.session() as session:
            for index in range(QUOTA):
                await session.reset("toy", split="train", index=index)
        # The server closes a stream's episodes just after the stream ends.
        for _ in range(100):
            if (await client.describe()).counters.live_episodes == 0:
                break
            await asyncio.sleep(0.1)
        opened = [await client.reset("toy", split="train", index=i) for i in range(QUOTA)]
        for episode in opened:
            await client.close(episode.episode_id)


async def test_another_principals_episode_does_not_exist(served: Served) -> None:
    async with served.client("team_a") as owner, served.client("team_b") as other:
        reset = await owner.reset("toy", split="test", index=4)
        with pytest.raises(NotFound) as step:
            await other.step(reset.episode_id, REPLY)
        with pytest.raises(NotFound) as verify:
            await other.verify(reset.episode_id)
        async with other.session() as session:
            with pytest.raises(NotFound) as in_session:
                await session.step(reset.episode_id, REPLY)
        closed_by_other = await other.close(reset.episode_id)
        own_step = await owner.step(reset.episode_id, REPLY)  # untouched by the other team
        assert (await owner.close(reset.episode_id)).closed
    assert {step.value.reason, verify.value.reason, in_session.value.reason} == {Reason.EPISODE_NOT_FOUND}
    assert not closed_by_other.closed
    assert own_step.reward.value == 1.0


def test_a_missing_token_file_stops_the_server_before_it_loads(tmp_path: Path) -> None:
    auth_file = tmp_path / "auth.yaml"
    auth_file.write_text("tokens:\n  - {principal: a, roles: [agent], token_file: missing.token}\n")
    result = subprocess.run(sciproto_command("serve", "env", "--env", "toy", "--port", "0", "--auth", str(auth_file)),
                            check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "missing.token" in result.stderr and "SCIPROTO_READY" not in result.stdout


async def test_forks_count_against_the_quota_and_another_principals_episode_cannot_be_forked(
        served: Served) -> None:
    async with served.client("team_a") as team_a, served.client("team_b") as team_b:
        parent = await team_a.reset("toy", split="train", index=0)
        fork = await team_a.fork(parent.episode_id)
        with pytest.raises(ResourceExhausted) as refused:
            await team_a.fork(parent.episode_id)  # parent and fork fill team_a's quota of 2
        assert refused.value.reason == Reason.TOO_MANY_EPISODES
        with pytest.raises(NotFound) as hidden:
            await team_b.fork(parent.episode_id)
        assert hidden.value.reason == Reason.EPISODE_NOT_FOUND
        await team_a.close(fork.episode_id)
        again = await team_a.fork(parent.episode_id)  # closing the fork gave its place back
        for episode_id in (parent.episode_id, again.episode_id):
            await team_a.close(episode_id)
