"""Sessions through the gateway with the `openai` SDK: a multi-turn session is one token-faithful
sequence, a rewritten history starts a new segment that says why, and a closed session becomes
rollout records (the lines `sciproto collect` writes)."""

from __future__ import annotations

import itertools
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway import sessions
from gateway.local import LocalGateway
from gateway.sessions import SessionLimits
from sciproto.client.rollouts import read_rollouts
from sciproto.processes import ServerProcess
from tests.gateway.conftest import serve_gateway


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gateway") / "rollouts.jsonl"


@pytest.fixture(scope="module")
def gateway(tiny_policy: ServerProcess, rollouts: Path) -> Iterator[ServerProcess]:
    server = serve_gateway("--policy", tiny_policy.target, "--rollouts", str(rollouts), "--max-sessions", "2")
    try:
        yield server
    finally:
        server.stop()


def _model(gateway: ServerProcess) -> str:
    return httpx.get(f"http://{gateway.target}/v1/models", timeout=30).json()["data"][0]["id"]


def _turns(client: openai.OpenAI, model: str, turns: int) -> list[dict]:
    messages: list[dict] = [{"role": "system", "content": "Count."}, {"role": "user", "content": "one"}]
    for turn in range(turns):
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=6, seed=turn)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": f"and {turn + 2}?"}]
    return messages


def test_a_multi_turn_session_is_one_token_faithful_sequence(gateway: ServerProcess, rollouts: Path) -> None:
    base = f"http://{gateway.target}"
    model = _model(gateway)
    client = openai.OpenAI(base_url=f"{base}/s/count-1/v1", api_key="unused", max_retries=0, timeout=120)
    messages = _turns(client, model, 3)
    calls = httpx.get(f"{base}/sessions/count-1", timeout=30).json()["calls"]
    assert [(c["segment"], c["extends"]) for c in calls] == [(0, False), (0, True), (0, True)]
    for before, after in itertools.pairwise(calls):
        sequence = before["prompt_token_ids"] + before["choices"][0]["completion_token_ids"]
        assert after["prompt_token_ids"][: len(sequence)] == sequence  # never re-tokenized
        assert len(after["prompt_token_ids"]) > len(sequence)  # the new user message's tokens follow

    # The agent drops its history: a new segment, and the call says why.
    # It also picks its own sampling: recorded with the call, and with its tokens in the record.
    client.chat.completions.create(model=model, messages=[messages[0], messages[-1]], max_tokens=4, seed=9,
                                   temperature=0.5, top_p=0.8, extra_body={"top_k": 7})
    last = httpx.get(f"{base}/sessions/count-1", timeout=30).json()["calls"][-1]
    assert (last["segment"], last["extends"]) == (1, False)
    assert last["sampling"] == {"temperature": 0.5, "top_p": 0.8, "top_k": 7}
    assert "do not start with the previous call's messages" in last["new_segment_reason"]

    closed = httpx.post(f"{base}/sessions/count-1/close", json={"group": "count/train/7", "reward": 0.5},
                        timeout=30).json()
    assert closed == {"session": "count-1", "group": "count/train/7", "records": 2, "segments": 2,
                      "rollout_ids": ["count/train/7/0", "count/train/7/0/segment1"]}
    records = list(read_rollouts(rollouts))
    # Two segments, one episode: one sample of the group.
    assert [(r.rollout_id, r.sample, r.episode) for r in records] == [
        ("count/train/7/0", 0, "count/train/7/0"), ("count/train/7/0/segment1", 0, "count/train/7/0")]
    first = records[0]
    final = calls[-1]
    assert first.token_ids == final["prompt_token_ids"] + final["choices"][0]["completion_token_ids"]
    sampled = [c["choices"][0] for c in calls]
    assert sum(first.loss_mask) == sum(len(s["completion_token_ids"]) for s in sampled)
    assert [lp for lp, mask in zip(first.logprobs, first.loss_mask, strict=True) if mask] == pytest.approx(
        [lp for s in sampled for lp in s["logprobs"]])
    assert first.reward == 0.5 and first.status == "SCORED" and first.group_id == "count/train/7"
    assert first.version_spans and first.turn_finish_reasons == [s["finish_reason"] for s in sampled]
    # every turn's tokens with the sampling that drew them: the gateway's defaults, then the agent's own
    turns = [(start, end) for start, end, *_ in first.version_spans]
    assert first.sampling_spans == [(start, end, 1.0, 1.0, 0) for start, end in turns]
    last_tokens = len(last["choices"][0]["completion_token_ids"])
    assert [tuple(span) for span in records[1].sampling_spans] == [
        (len(records[1].token_ids) - last_tokens, len(records[1].token_ids), 0.5, 0.8, 7)]
    assert [m.role for m in first.messages] == ["system", "user", "assistant", "user", "assistant", "user",
                                                "assistant"]
    taken = httpx.post(f"{base}/groups/count%2Ftrain%2F7/take", timeout=30).json()
    assert [r["rollout_id"] for r in taken["records"]] == ["count/train/7/0", "count/train/7/0/segment1"]
    assert httpx.post(f"{base}/groups/count%2Ftrain%2F7/take", timeout=30).json()["records"] == []


def test_a_reply_the_gateway_never_returned_starts_a_new_segment(gateway: ServerProcess) -> None:
    base = f"http://{gateway.target}"
    model = _model(gateway)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120,
                           default_headers={"X-Sciproto-Session": "edited"})
    first = [{"role": "user", "content": "hi"}]
    client.chat.completions.create(model=model, messages=first, max_tokens=4)
    client.chat.completions.create(model=model, max_tokens=4, messages=[
        *first, {"role": "assistant", "content": "an answer I wrote myself"}, {"role": "user", "content": "so?"}])
    calls = httpx.get(f"{base}/sessions/edited", timeout=30).json()["calls"]
    assert calls[1]["extends"] is False and "not an assistant message it returned" in calls[1]["new_segment_reason"]
    closed = httpx.post(f"{base}/sessions/edited/close", json={"group": "g", "reward": 1.0}, timeout=30)
    assert closed.json()["group"] == "gateway/g/0"


def test_sessions_are_bounded_and_closing_needs_an_outcome(gateway: ServerProcess) -> None:
    base = f"http://{gateway.target}"
    model = _model(gateway)
    body = {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    for session in ("a", "b"):
        assert httpx.post(f"{base}/s/{session}/v1/chat/completions", json=body, timeout=60).status_code == 200
    refused = httpx.post(f"{base}/s/c/v1/chat/completions", json=body, timeout=60)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_sessions"
    assert int(refused.headers["Retry-After"]) >= 1  # OpenAI clients wait this long before retrying
    no_reward = httpx.post(f"{base}/sessions/a/close", json={"group": "g"}, timeout=30)
    assert no_reward.status_code == 400 and no_reward.json()["error"]["param"] == "reward"
    for session in ("a", "b"):
        assert httpx.post(f"{base}/sessions/{session}/close", json={"group": "g", "status": "INFRA_ERROR",
                                                                    "error": "the agent crashed"},
                          timeout=30).status_code == 200
    missing = httpx.get(f"{base}/sessions/a", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "session_not_found"


def test_idle_sessions_expire_and_are_counted_and_sizes_are_capped(tiny_policy: ServerProcess) -> None:
    server = serve_gateway("--policy", tiny_policy.target, "--session-ttl", "2", "--max-session-tokens", "100")
    try:
        base = f"http://{server.target}"
        body = {"model": _model(server), "messages": [{"role": "user", "content": "a long enough question"}],
                "max_tokens": 4, "temperature": 0}  # a prompt of 41 tokens with the tiny model's template
        greedy = {**body, "max_tokens": 500}
        for session in ("big", "one-call"):
            # No call takes a session past its limit: a completion is cut where the limit falls.
            calls = [httpx.post(f"{base}/s/{session}/v1/chat/completions", json=body if (session, n) == ("big", 0)
                                else greedy, timeout=60) for n in range(2 if session == "big" else 1)]
            assert [c.status_code for c in calls] == [200] * len(calls), calls[-1].text
            recorded = httpx.get(f"{base}/sessions/{session}", timeout=30).json()["tokens"]
            assert recorded <= 100 and (recorded == 100 or calls[-1].json()["choices"][0]["finish_reason"] == "stop")
        refused = httpx.post(f"{base}/s/big/v1/chat/completions", json=body, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "session_too_large"
        assert "--max-session-tokens" in refused.json()["error"]["message"]
        time.sleep(2.5)  # past the idle TTL (a bound being exceeded, not a speed being measured)
        assert httpx.get(f"{base}/sessions/big", timeout=30).status_code == 404
        assert httpx.get(f"{base}/health", timeout=30).json()["expired_sessions"] == 2
    finally:
        server.stop()


async def test_a_call_longer_than_the_idle_ttl_keeps_its_session(tiny_policy: ServerProcess,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The idle TTL counts from a call's end: a session whose calls each last past the TTL is
    never idle, so its next call extends it (not a fresh session under the same name)."""
    clock = types.SimpleNamespace(offset=0.0)
    monkeypatch.setattr(sessions, "time", types.SimpleNamespace(monotonic=lambda: time.monotonic() + clock.offset))
    async with LocalGateway([tiny_policy.target], SessionLimits(idle_ttl_s=60)) as local:
        assert local.gateway is not None
        policy = local.gateway.policies[0]
        generate = policy.generate

        def lasting(request: Any, timeout_s: float | None = None) -> Any:  # the clock passes the TTL mid-call
            clock.offset += 120
            return generate(request, timeout_s)

        monkeypatch.setattr(policy, "generate", lasting)
        client = openai.AsyncOpenAI(base_url=local.base_url("long"), api_key="unused", max_retries=0, timeout=120)
        messages: list[dict] = [{"role": "user", "content": "one"}]
        reply = await client.chat.completions.create(model=local.model, messages=messages, max_tokens=3)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "two"}]
        await client.chat.completions.create(model=local.model, messages=messages, max_tokens=3)
        session = local.gateway.store.get("long", "")
        assert [(call.segment, call.extends) for call in session.calls] == [(0, False), (0, True)]
        assert local.gateway.store.expired == 0


def _one_call_session(base: str, session: str, model: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    assert httpx.post(f"{base}/s/{session}/v1/chat/completions", json=body, timeout=60).status_code == 200


def test_closed_records_not_taken_are_bounded_and_nothing_goes_silently(tiny_policy: ServerProcess,
                                                                         tmp_path: Path) -> None:
    # Without a rollouts file the records exist only in memory: a full gateway refuses the close
    # (the session stays open) until its groups are taken.
    server = serve_gateway("--policy", tiny_policy.target, "--max-held-records", "2")
    try:
        base = f"http://{server.target}"
        model = _model(server)
        for session in ("a", "b", "c"):
            _one_call_session(base, session, model)
        for session in ("a", "b"):
            assert httpx.post(f"{base}/sessions/{session}/close", json={"group": "g", "reward": 1.0},
                              timeout=30).status_code == 200
        refused = httpx.post(f"{base}/sessions/c/close", json={"group": "h", "reward": 1.0}, timeout=30)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_held_records"
        assert int(refused.headers["Retry-After"]) >= 1 and "/groups/" in refused.json()["error"]["message"]
        assert httpx.get(f"{base}/sessions/c", timeout=30).status_code == 200  # still open, nothing lost
        assert httpx.get(f"{base}/health", timeout=30).json()["held_records"] == 2
        assert len(httpx.post(f"{base}/groups/g/take", timeout=30).json()["records"]) == 2
        assert httpx.post(f"{base}/sessions/c/close", json={"group": "h", "reward": 1.0},
                          timeout=30).status_code == 200
    finally:
        server.stop()

    # With a rollouts file every record is in the file: the oldest untaken ones leave memory, and
    # the count of them is reported where they would have been taken.
    rollouts = tmp_path / "held.jsonl"
    server = serve_gateway("--policy", tiny_policy.target, "--max-held-records", "1", "--rollouts", str(rollouts))
    try:
        base = f"http://{server.target}"
        model = _model(server)
        for session in ("a", "b"):
            _one_call_session(base, session, model)
            assert httpx.post(f"{base}/sessions/{session}/close", json={"group": "g", "reward": 1.0},
                              timeout=30).status_code == 200
        assert httpx.get(f"{base}/health", timeout=30).json() | {"sessions": 0} == {
            "status": "ok", "sessions": 0, "expired_sessions": 0, "held_records": 1, "released_records": 1}
        taken = httpx.post(f"{base}/groups/g/take", timeout=30).json()
        assert [r["rollout_id"] for r in taken["records"]] == ["gateway/g/0/1"] and taken["released"] == 1
        assert [r.rollout_id for r in read_rollouts(rollouts)] == ["gateway/g/0/0", "gateway/g/0/1"]
    finally:
        server.stop()
