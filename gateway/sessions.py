"""Sessions: every call recorded with its exact tokens, and the rule that keeps a multi-turn
session one token-faithful sequence.

A call *extends* the previous call of its session when its messages are the previous call's
messages, then one of the assistant messages the gateway returned for it, then anything new, with
the same tools. It is then sent with `previous_token_ids` = the previous prompt + that sample's
completion, and the policy server appends only the tokens of the new messages. Any other call
(earlier messages rewritten or dropped, tools changed, an assistant message the gateway never
returned) starts a new *segment* with a fresh prompt, and the call records why.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from gateway.chat import ChatCall, Choice
from gateway.errors import ApiError
from sciproto.pb import common_pb2, policy_pb2
from sciproto.sampling import UNTRANSFORMED, Distribution, distribution_from_pb

__all__ = ["CallRecord", "Plan", "Session", "SessionLimits", "SessionStore"]


@dataclass
class CallRecord:
    """One chat completion of a session, as the policy saw and sampled it."""

    segment: int
    extends: bool  # continued the previous call's exact tokens
    new_segment_reason: str  # why it did not, "" when it did (or when it is the first call)
    prompt_token_ids: list[int]
    policy_version: int
    messages: list[common_pb2.ChatMessage]
    normal_messages: list[dict[str, Any]]
    normal_tools: list[dict[str, Any]]
    choices: list[Choice]
    chosen: int = 0  # the sample the session went on with (the next call's assistant message)
    # The distribution the call's samples were drawn from: the temperature, top_p and top_k the
    # agent sent (unset: sciproto.sampling's defaults), so training computes log pi under it.
    sampling: Distribution = UNTRANSFORMED

    @property
    def tokens(self) -> int:
        return len(self.prompt_token_ids) + sum(len(c.sample.completion_token_ids) for c in self.choices)

    def to_json(self) -> dict[str, Any]:
        return {
            "segment": self.segment, "extends": self.extends, "new_segment_reason": self.new_segment_reason,
            "prompt_token_ids": self.prompt_token_ids, "policy_version": self.policy_version, "chosen": self.chosen,
            "sampling": self.sampling._asdict(),
            "choices": [{"completion_token_ids": list(c.sample.completion_token_ids),
                         "logprobs": list(c.sample.logprobs), "finish_reason": c.finish_reason,
                         "version_spans": [[s.start, s.end, s.policy_version] for s in c.sample.version_spans]}
                        for c in self.choices],
        }


@dataclass
class Plan:
    """How the next call is sent: the previous ids to extend (empty: a new segment) and why."""

    previous_token_ids: list[int]
    reason: str
    continued: tuple[CallRecord, int] | None  # the call and sample it extends


@dataclass
class Session:
    id: str
    principal: str
    created: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    calls: list[CallRecord] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one call of a session at a time

    @property
    def tokens(self) -> int:
        return sum(call.tokens for call in self.calls)

    @property
    def segments(self) -> int:
        return self.calls[-1].segment + 1 if self.calls else 0

    def plan(self, call: ChatCall) -> Plan:
        if not self.calls:
            return Plan([], "", None)
        last = self.calls[-1]
        known = len(last.normal_messages)
        if call.normal_tools != last.normal_tools:
            return Plan([], "the tools differ from the previous call's", None)
        if call.normal_messages[:known] != last.normal_messages:
            return Plan([], "the messages do not start with the previous call's messages", None)
        if len(call.normal_messages) <= known:
            return Plan([], "the messages add nothing to the previous call's (a retry samples afresh)", None)
        reply = call.normal_messages[known]
        chosen = next((c.index for c in last.choices if c.normal_message() == reply), None)
        if chosen is None:
            return Plan([], "the message after the previous call's is not an assistant message it returned", None)
        sample = last.choices[chosen].sample
        if sample.finish_reason == policy_pb2.FINISH_REASON_ABORT:
            return Plan([], "the previous completion was aborted", None)
        return Plan(last.prompt_token_ids + list(sample.completion_token_ids), "", (last, chosen))

    def record(self, call: ChatCall, plan: Plan, reason: str, prompt_ids: list[int], policy_version: int,
               choices: list[Choice]) -> CallRecord:
        extends = plan.continued is not None and not reason
        if plan.continued is not None and extends:
            plan.continued[0].chosen = plan.continued[1]
        segment = (self.calls[-1].segment + (0 if extends else 1)) if self.calls else 0
        record = CallRecord(segment, extends, reason, prompt_ids, policy_version, call.messages,
                            call.normal_messages, call.normal_tools, choices,
                            sampling=distribution_from_pb(call.sampling_params()))
        self.calls.append(record)
        return record

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "calls": [call.to_json() for call in self.calls], "segments": self.segments,
                "tokens": self.tokens}


@dataclass(frozen=True)
class SessionLimits:
    max_sessions: int = 1024
    idle_ttl_s: float = 3600.0
    max_tokens: int = 1 << 20  # recorded tokens of one session, prompts counted per call
    max_held_records: int = 4096  # closed sessions' records held until a group is taken


class SessionStore:
    """Open sessions, bounded in number, idle time and size. A session idle past its TTL is dropped
    and counted in `expired` (its records are gone: close sessions to keep them)."""

    def __init__(self, limits: SessionLimits) -> None:
        self.limits = limits
        # In order of last use, oldest first, so that a sweep reads only the sessions it drops
        # (and those in a call): every call sweeps, and a scan of all sessions would cost each
        # call time in proportion to the number open.
        self.sessions: OrderedDict[str, Session] = OrderedDict()
        self.expired = 0

    def sweep(self) -> None:
        deadline = time.monotonic() - self.limits.idle_ttl_s
        idle = []
        for key, session in self.sessions.items():
            if session.last_used >= deadline:
                break  # this one and all after it were used since the deadline
            if not session.lock.locked():
                idle.append(key)
        for key in idle:
            del self.sessions[key]
        self.expired += len(idle)

    def open(self, session_id: str, principal: str) -> Session:
        self.sweep()
        session = self.sessions.get(session_id)
        if session is None:
            if len(self.sessions) >= self.limits.max_sessions:
                raise ApiError(429, f"the gateway holds {len(self.sessions)} open sessions, its limit; close "
                               "finished sessions (POST /sessions/{id}/close) or wait for idle ones to expire",
                               type_="rate_limit_error", code="too_many_sessions", retry_after_s=1.0)
            session = self.sessions[session_id] = Session(session_id, principal)
        elif session.principal != principal:
            raise ApiError(404, f"no session {session_id!r} for this caller", code="session_not_found")
        session.last_used = time.monotonic()
        self.sessions.move_to_end(session_id)
        return session

    def touch(self, session: Session) -> None:
        """`session` was used now (the end of a call: the idle TTL counts from there)."""
        session.last_used = time.monotonic()
        if self.sessions.get(session.id) is session:
            self.sessions.move_to_end(session.id)

    def check_size(self, session: Session) -> None:
        if session.tokens >= self.limits.max_tokens:
            raise ApiError(400, f"session {session.id!r} has recorded {session.tokens} tokens, its limit of "
                           f"{self.limits.max_tokens} (--max-session-tokens); close it and start another", param="session",
                           code="session_too_large")

    def get(self, session_id: str, principal: str) -> Session:
        self.sweep()
        session = self.sessions.get(session_id)
        if session is None or session.principal != principal:
            raise ApiError(404, f"no open session {session_id!r} (never used, closed, or idle past "
                           f"{self.limits.idle_ttl_s:.0f} s)", code="session_not_found")
        return session

    def pop(self, session_id: str, principal: str) -> Session:
        session = self.get(session_id, principal)
        del self.sessions[session_id]
        return session
