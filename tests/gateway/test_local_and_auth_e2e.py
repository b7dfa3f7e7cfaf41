"""The in-process API (agents that are Python functions), and the gateway behind role tokens,
with the policy server behind its own."""

from __future__ import annotations

import secrets
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from clients.train import group_to_pb, with_epoch
from gateway.local import LocalGateway
from learner.config import GRPOConfig
from learner.grpo import group_advantages, prepare_batch
from learner.service import group_from_pb
from sciproto.client.rollouts import RolloutRecord, RolloutStatus
from sciproto.processes import ServerProcess, start_server
from tests.gateway.conftest import serve_gateway


async def test_a_group_of_function_agents_becomes_one_rollout_group(tiny_policy: ServerProcess) -> None:
    def agent(base_url: str) -> float:
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": "Say yes."}]
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=5)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Again."}]
        client.chat.completions.create(model=model, messages=messages, max_tokens=5)
        if "/run2-" in base_url:
            raise RuntimeError("this run's tool broke")
        return 1.0 if "/run0-" in base_url else 0.0

    async with LocalGateway([tiny_policy.target]) as gateway:
        group = await gateway.run_group(agent, "yes/train/2", size=3)
        silent = await gateway.run_group(lambda base_url: 1.0, "never-called", size=1)
    assert [(r.status, r.error, r.group_id) for r in silent.rollouts] == [
        (RolloutStatus.INFRA_ERROR, "the agent returned without calling the model", "gateway/never-called/0")]
    assert group.group_id == "yes/train/2" and [r.sample for r in group.rollouts] == [0, 1, 2]
    by_session = {r.task["session"][3]: r for r in group.rollouts}
    assert by_session["0"].reward == 1.0 and by_session["1"].reward == 0.0
    assert by_session["2"].status is RolloutStatus.INFRA_ERROR and "tool broke" in by_session["2"].error
    assert not group.complete  # an INFRA_ERROR sample masks the group out of training
    for record in group.rollouts:
        assert record.steps == 2 and record.task["segments"] == "1" and sum(record.loss_mask) > 0


async def test_a_session_that_rewrites_its_history_is_one_sample_of_its_group(tiny_policy: ServerProcess) -> None:
    """Run 0 starts over halfway (a new segment of its session): its group still has three
    samples, the learner's statistics count its reward once, and both its segments train with
    its advantage."""
    def agent(base_url: str) -> float:
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say yes."}], max_tokens=4)
        if "/run0-" not in base_url:
            return 0.0
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Start over."}],
                                       max_tokens=4)
        return 1.0

    async with LocalGateway([tiny_policy.target]) as gateway:
        group = await gateway.run_group(agent, "rewrite/train/0", size=3)
    by_session: dict[str, list[RolloutRecord]] = {}
    for record in group.rollouts:
        by_session.setdefault(record.task["session"], []).append(record)
    rewritten = next(records for records in by_session.values() if len(records) == 2)
    assert len(by_session) == 3 and len(group.rollouts) == 4 and {r.reward for r in rewritten} == {1.0}
    assert [r.task["segment"] for r in rewritten] == ["0", "1"] and {r.task["segments"] for r in rewritten} == {"2"}

    trained = group_from_pb(group_to_pb(group.group_id, group.rollouts), vocab_size=10**6)
    config = GRPOConfig()
    plan = prepare_batch([trained], config)
    expected = group_advantages([1.0, 0.0, 0.0], config.adv_eps)
    assert expected is not None
    assert sorted(plan.advantages) == pytest.approx(sorted(expected))  # one advantage per episode
    assert sorted(plan.scored_rewards) == [0.0, 0.0, 1.0]
    assert sorted(seq.advantage for seq in plan.sequences) == pytest.approx(sorted([expected[0], *expected]))
    segment_tokens = sorted(sum(r.loss_mask) for r in rewritten)
    assert sorted(int(seq.loss_mask.sum()) for seq in plan.sequences if seq.advantage > 0) == segment_tokens
    # The rollout file says so: both segments are sample k, episode "rewrite/train/0/k".
    assert group.size == 3 and len({r.rollout_id for r in group.rollouts}) == 4
    assert {(r.sample, r.episode) for r in rewritten} == {(rewritten[0].sample, rewritten[0].rollout_id)}
    assert rewritten[1].rollout_id == f"{rewritten[0].rollout_id}/segment1"
    assert sorted(r.sample for r in group.rollouts if not r.episode) == sorted({0, 1, 2} - {rewritten[0].sample})
    # A training run renames a group for its pass over the tasks; the segments stay one episode.
    _, renamed = with_epoch(group, 2)
    assert len({r.rollout_id for r in renamed}) == 4
    assert {r.episode for r in renamed if r.episode} == {f"rewrite/train/0#2/{rewritten[0].sample}"}


def test_the_gateway_takes_the_servers_role_tokens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = {name: secrets.token_urlsafe(24) for name in ("agent", "grader", "trainer", "gateway")}
    for name, token in tokens.items():
        monkeypatch.setenv(f"GW_TOKEN_{name.upper()}", token)
    (tmp_path / "auth.yaml").write_text("tokens:\n" + "".join(
        f"  - {{principal: {name}, roles: [{role}], token_env: GW_TOKEN_{name.upper()}}}\n"
        for name, role in (("agent", "agent"), ("grader", "agent, grader"), ("trainer", "trainer"),
                           ("gateway", "agent, observer"))))
    (tmp_path / "gateway.token").write_text(tokens["gateway"])
    auth = ["--auth", str(tmp_path / "auth.yaml")]
    policy = start_server(["serve", "policy", "--model", "tiny", "--port", "0", *auth], timeout_s=300)
    try:
        gateway = serve_gateway("--policy", policy.target, *auth, "--policy-token-file",
                                str(tmp_path / "gateway.token"))
        try:
            base = f"http://{gateway.target}"
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
            # A caller without a key is told what to send in HTTP's terms, not gRPC's.
            anonymous = httpx.get(f"{base}/v1/models", timeout=30)
            assert anonymous.status_code == 401, anonymous.text
            said = anonymous.json()["error"]["message"]
            assert "Authorization: Bearer" in said and "metadata" not in said and "ChannelConfig" not in said
            agent = openai.OpenAI(base_url=f"{base}/s/x/v1", api_key=tokens["agent"], max_retries=0, timeout=120)
            model = agent.models.list().data[0].id
            agent.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
            # The anthropic SDK sends its api_key as `x-api-key`: the same session, the same principal.
            claude = anthropic.Anthropic(base_url=f"{base}/s/x", api_key=tokens["agent"], max_retries=0, timeout=120)
            claude.messages.create(model=model, max_tokens=3, messages=[{"role": "user", "content": "hi"}])
            with pytest.raises(anthropic.AuthenticationError) as refused:
                anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0, timeout=120).messages.create(
                    model=model, max_tokens=3, messages=[{"role": "user", "content": "hi"}])
            assert refused.value.body["error"]["type"] == "authentication_error"
            grading = {"group": "g", "reward": 1.0}
            as_agent = httpx.post(f"{base}/sessions/x/close", json=grading, timeout=30,
                                  headers={"Authorization": f"Bearer {tokens['agent']}"})
            assert as_agent.status_code == 403 and as_agent.json()["error"]["type"] == "permission_error"
            # Another principal does not see the agent's session.
            as_grader = httpx.post(f"{base}/sessions/x/close", json=grading, timeout=30,
                                   headers={"Authorization": f"Bearer {tokens['grader']}"})
            assert as_grader.status_code == 404
            take = httpx.post(f"{base}/groups/g/take", timeout=30,
                              headers={"Authorization": f"Bearer {tokens['agent']}"})
            assert take.status_code == 403
            take = httpx.post(f"{base}/groups/g/take", timeout=30,
                              headers={"Authorization": f"Bearer {tokens['trainer']}"})
            assert take.status_code == 200 and take.json()["records"] == []
            # A task's label has slashes; its group is found by the label as written.
            grader = {"Authorization": f"Bearer {tokens['grader']}"}
            assert httpx.post(f"{base}/s/y/v1/chat/completions", headers=grader, timeout=120, json={
                "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}).status_code == 200
            closed = httpx.post(f"{base}/sessions/y/close", json={"group": "toy/train/0", "reward": 1.0},
                                headers=grader, timeout=30)
            assert closed.status_code == 200 and closed.json()["group"] == "toy/train/0", closed.text
            take = httpx.post(f"{base}/groups/toy/train/0/take", timeout=30,
                              headers={"Authorization": f"Bearer {tokens['trainer']}"})
            assert take.status_code == 200, take.text
            assert [r["rollout_id"] for r in take.json()["records"]] == ["toy/train/0/0"]
        finally:
            gateway.stop()
    finally:
        policy.stop()


def test_a_graded_close_is_charged_once_and_a_429_says_when_to_retry(
        tiny_policy: ServerProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token = secrets.token_urlsafe(24)
    monkeypatch.setenv("GW_TOKEN_GRADER", token)
    # Three requests at once, then one every 100 s: a call, a graded close, then a refusal.
    (tmp_path / "auth.yaml").write_text(
        "tokens:\n  - {principal: grader, roles: [agent, grader], token_env: GW_TOKEN_GRADER,\n"
        "     limits: {requests_per_second: 0.01, burst: 3}}\n")
    gateway = serve_gateway("--policy", tiny_policy.target, "--auth", str(tmp_path / "auth.yaml"),
                            "--model-name", "m")
    try:
        base, headers = f"http://{gateway.target}", {"Authorization": f"Bearer {token}"}
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert httpx.post(f"{base}/s/once/v1/chat/completions", json=body, headers=headers,
                          timeout=120).status_code == 200
        closed = httpx.post(f"{base}/sessions/once/close", json={"group": "g", "reward": 1.0}, headers=headers,
                            timeout=30)
        assert closed.status_code == 200, closed.json()
        assert httpx.get(f"{base}/v1/models", headers=headers, timeout=30).status_code == 200  # the third
        refused = httpx.get(f"{base}/v1/models", headers=headers, timeout=30)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limited"
        assert 1 <= int(refused.headers["Retry-After"]) <= 100
        assert 0 < int(refused.headers["retry-after-ms"]) <= 100_000
    finally:
        gateway.stop()
