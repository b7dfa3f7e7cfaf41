"""`sciproto serve env|policy|learner --auth FILE` end to end: one auth file for every server,
a collection that reaches them with its tokens, the policy server's roles (sampling needs
AGENT, pushing weights TRAINER) and the learner's (TrainStep needs TRAINER)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch

from clients.collect import CollectConfig, run_collection
from sciproto import pb
from sciproto.channel import ChannelConfig, make_channel
from sciproto.client.policy import PolicyClient, generate_request
from sciproto.config import load_config
from sciproto.errors import PermissionDenied, Reason, Unauthenticated, from_rpc_error
from sciproto.models import load_model
from sciproto.processes import ServerProcess, start_server

TOKEN_ENV = {"rollout": "AUTH_E2E_ROLLOUT_TOKEN", "trainer": "AUTH_E2E_TRAINER_TOKEN"}
FAST = ["sampling.max_tokens=8", "max_steps=1", "progress=false"]


@dataclass(frozen=True)
class Servers:
    env: ServerProcess
    policy: ServerProcess
    tokens: dict[str, str]
    auth_file: Path

    def policy_client(self, principal: str | None) -> PolicyClient:
        token = self.tokens[principal] if principal else None
        return PolicyClient(ChannelConfig(target=self.policy.target, token=token, max_attempts=1))


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    folder = tmp_path_factory.mktemp("auth")
    tokens = {name: secrets.token_urlsafe(32) for name in TOKEN_ENV}
    # A rollout client plays (agent), has its episodes graded (Verify needs grader) and sizes the
    # split first (Describe needs observer).
    (folder / "auth.yaml").write_text(f"""
tokens:
  - {{principal: rollout, roles: [agent, grader, observer], token_env: {TOKEN_ENV["rollout"]}}}
  - {{principal: trainer, roles: [trainer, observer], token_env: {TOKEN_ENV["trainer"]}}}
""")
    with pytest.MonkeyPatch.context() as patch:
        for name, variable in TOKEN_ENV.items():
            patch.setenv(variable, tokens[name])  # read by the servers and by the collection
        auth = ["--auth", str(folder / "auth.yaml")]
        env = start_server(["serve", "env", "--env", "toy", "--port", "0", *auth])
        try:
            policy = start_server(["serve", "policy", "--model", "tiny", "--port", "0", *auth])
            try:
                yield Servers(env, policy, tokens, folder / "auth.yaml")
            finally:
                policy.stop()
        finally:
            env.stop()


async def test_collection_reaches_both_servers_with_its_token(servers: Servers, tmp_path: Path) -> None:
    token = [f"env_access.token_env={TOKEN_ENV['rollout']}", f"policy_access.token_env={TOKEN_ENV['rollout']}"]
    config = load_config(CollectConfig, None, [*FAST, *token])
    summary = await run_collection([servers.env.target], [servers.policy.target], "toy:test", tmp_path / "a.jsonl",
                                   2, 1, 2, config)
    assert summary.rollouts == summary.scored == 2
    with pytest.raises(Unauthenticated):
        await run_collection([servers.env.target], [servers.policy.target], "toy:test", tmp_path / "b.jsonl",
                             2, 1, 2, load_config(CollectConfig, None, FAST))


async def test_policy_roles(servers: Servers) -> None:
    request = generate_request(prompt_token_ids=[1, 2, 3], max_tokens=2)
    async with servers.policy_client(None) as anonymous:
        with pytest.raises(Unauthenticated):
            await anonymous.generate_group(request)
    weights = load_model("tiny", dtype=torch.float32, seed=0).model.state_dict()
    async with servers.policy_client("rollout") as rollout, servers.policy_client("trainer") as trainer:
        group = await rollout.generate_group(request)
        with pytest.raises(PermissionDenied) as denied:
            await rollout.push_weights(weights, version=1)
        with pytest.raises(PermissionDenied):
            await trainer.generate_group(request)
        pushed = await trainer.push_weights(weights, version=1)
        described = await trainer.describe()
    assert len(group.samples) == 1 and group.policy_version == 0
    assert denied.value.reason == Reason.PERMISSION_DENIED and "'trainer'" in denied.value.message
    assert pushed.policy_version == described.policy_version == 1
    assert list(described.server.auth_roles) == ["agent", "observer", "trainer"]


async def test_learner_roles(servers: Servers, tmp_path: Path) -> None:
    """`sciproto serve learner --auth FILE`: TrainStep and Describe need trainer/observer."""
    with pytest.MonkeyPatch.context() as patch:
        for name, variable in TOKEN_ENV.items():
            patch.setenv(variable, servers.tokens[name])
        learner = start_server(["serve", "learner", "--port", "0", "--auth", str(servers.auth_file),
                                "--set", f"run_dir={tmp_path / 'run'}"])
    try:
        def channel(principal: str | None) -> grpc.aio.Channel:
            token = servers.tokens[principal] if principal else None
            return make_channel(ChannelConfig(target=learner.target, token=token, max_attempts=1))

        async with channel("trainer") as trainer:
            described = await pb.learner_grpc.LearnerServiceStub(trainer).Describe(
                pb.learner_pb2.LearnerServiceDescribeRequest())
        failures = []
        for principal in (None, "rollout"):
            async with channel(principal) as refused:
                call = pb.learner_grpc.LearnerServiceStub(refused).TrainStep(
                    iter([pb.learner_pb2.TrainStepRequest()]))
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    async for _ in call:
                        pass
            failures.append(from_rpc_error(caught.value))
    finally:
        learner.stop()
    assert list(described.server.auth_roles) == ["observer", "trainer"]
    assert [type(f) for f in failures] == [Unauthenticated, PermissionDenied]
