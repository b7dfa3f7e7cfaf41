"""The gateway's HTTP routes (aiohttp): OpenAI's chat completions and models, and the session and
group routes that turn recorded calls into rollout records.

    POST /v1/chat/completions            a call outside any session (not recorded)
    POST /s/{session}/v1/chat/completions  the same, recorded in `session` (opened by its first call)
    POST /v1/responses, /s/{session}/v1/responses  the Responses API's subset (gateway.responses)
    POST /v1/messages, /s/{session}/v1/messages    Anthropic's Messages API (gateway.messages)
    GET  /v1/models, /s/{session}/v1/models
    GET  /sessions/{session}             the session's calls: token ids, logprobs, versions, segments
    POST /sessions/{session}/close       {"group": label, "reward": float}: its records join the group
    POST /groups/{label}/take            the group's records so far, handed over once (and how many
                                         were released from memory to the rollouts file first)
    GET  /health

A session may also be named by the `X-Sciproto-Session` header on the plain /v1 routes.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from gateway.chat import (
    ChatCall,
    Choice,
    completion_object,
    now,
    parse_chat_request,
)
from gateway.errors import ApiError, from_sciproto
from gateway.limits import DEFAULT_MAX_REQUEST_BYTES, read_json
from gateway.messages import (
    anthropic_error,
    message_object,
    new_message_id,
    parse_messages_request,
    stream_message,
)
from gateway.records import Outcome, failed_record, session_records, task_for_label
from gateway.responses import as_responses_error, parse_responses_request, response_object
from gateway.sessions import Plan, Session, SessionStore
from gateway.streaming import stream_chat, stream_response
from sciproto.auth import Authenticator, AuthRole, charge_request
from sciproto.client.policy import PolicyClient
from sciproto.client.rollouts import RolloutRecord, RolloutStatus
from sciproto.errors import InvalidArgument, Reason, SciprotoError
from sciproto.pb import policy_pb2

__all__ = ["SESSION_HEADER", "Gateway"]

log = logging.getLogger("gateway")
SESSION_HEADER = "X-Sciproto-Session"
_ROUTES = ("the model routes are /v1/chat/completions, /v1/responses, /v1/messages and /v1/models, each also "
           "under /s/{session}")
# The authenticator's words are for gRPC callers (metadata, ChannelConfig); an HTTP caller is told
# what to send in its own terms.
_HTTP_AUTH_MESSAGES = {
    "missing_token": "this gateway requires an API key: send the header `Authorization: Bearer <token>` (the "
                     "openai SDK's `api_key`, the anthropic SDK's `auth_token`) with a token the gateway's auth "
                     "file lists",
    "unknown_token": "the API key (the bearer token in `Authorization`) is not one this gateway accepts: check "
                     "which token the gateway's auth file lists for you",
}


class Gateway:
    """The routes over a set of policy servers serving one model. Calls of a session go to one
    server (its tokens and cache stay there); calls outside sessions take turns."""

    def __init__(self, policies: list[PolicyClient], model_names: list[str], max_context_tokens: int,
                 store: SessionStore, authenticator: Authenticator | None = None,
                 rollouts_file: Path | None = None, generate_timeout_s: float = 600.0,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, adapter: str = "") -> None:
        if not policies:
            raise ValueError("the gateway needs at least one policy server")
        self.policies = policies
        self.model_names = model_names
        # The LoRA adapter `model_names` route to ("": the base weights); any other adapter the policy
        # servers hold answers to its own name (Describe's adapters, asked when a call names one).
        self.adapter = adapter
        # Adapters a Describe has shown held: a policy server never unloads one (protocol 1.4 has no
        # removal), so a call naming one routes without asking again; an unknown name asks.
        self._known_adapters: set[str] = set()
        self.max_context_tokens = max_context_tokens
        self.store = store
        self.authenticator = authenticator
        self.rollouts_file = rollouts_file
        self.generate_timeout_s = generate_timeout_s
        self.max_request_bytes = max_request_bytes
        # Closed records until taken, at most store.limits.max_held_records of them: past it, a
        # gateway with a rollouts file releases the oldest from memory (they are in the file) and
        # counts them per group; one without refuses closes until groups are taken.
        self.groups: dict[str, list[RolloutRecord]] = {}
        self.held_records = 0
        self.released: dict[str, int] = {}
        self.released_records = 0
        self._next_sample: dict[str, int] = {}
        self._turns = itertools.count()

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors], client_max_size=self.max_request_bytes)
        app.add_routes([
            web.get("/health", self._health),
            web.get("/v1/models", self._models), web.get("/s/{session}/v1/models", self._models),
            web.post("/v1/chat/completions", self._chat), web.post("/s/{session}/v1/chat/completions", self._chat),
            web.post("/v1/responses", self._responses), web.post("/s/{session}/v1/responses", self._responses),
            web.post("/v1/messages", self._messages), web.post("/s/{session}/v1/messages", self._messages),
            web.get("/sessions/{session}", self._session),
            web.post("/sessions/{session}/close", self._close),
            web.post("/groups/{label:.+}/take", self._take),  # a label has slashes: "gsm8k/train/3"
        ])
        return app

    # -- plumbing ---------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as error:
            return web.json_response(error.body(), status=error.status, headers=error.headers())
        except SciprotoError as error:
            api = from_sciproto(error)
            return web.json_response(api.body(), status=api.status, headers=api.headers())
        except web.HTTPException as error:
            if error.status < 400:
                raise
            said = f"{request.method} {request.path}: {error.reason}"
            if error.status == 404:
                said += (f"; {_ROUTES}: check the client's base URL (the openai SDK's ends in /v1, the anthropic "
                         "SDK's does not)")
            api = ApiError(error.status, said, code="not_found" if error.status == 404 else None)
            return web.json_response(api.body(), status=api.status)

    def _principal(self, request: web.Request, role: AuthRole, *, charge: bool = True) -> str:
        """The caller's principal name ("" with auth off), once it holds `role`. A request is
        charged against the principal's rate once: a second role check passes `charge=False`."""
        if self.authenticator is None:
            return ""
        header = request.headers.get("Authorization")
        if header is None and request.headers.get("x-api-key"):  # the anthropic SDK's api_key
            header = f"Bearer {request.headers['x-api-key']}"
        try:
            principal = self.authenticator.identify([("authorization", header)] if header else [])
            if not principal.has_role(role):
                raise ApiError(403, f"this route requires role {role.value!r}; principal {principal.name!r} holds "
                               f"{', '.join(sorted(principal.roles))}", type_="permission_error",
                               code="permission_denied")
            if charge:
                charge_request(principal)
        except SciprotoError as error:
            if error.code.name == "RESOURCE_EXHAUSTED":
                raise ApiError(429, error.message, type_="rate_limit_error", code="rate_limited",
                               retry_after_s=error.retry_after_s or 1.0) from None
            raise ApiError(401, _HTTP_AUTH_MESSAGES.get(error.metadata.get("cause", ""), error.message),
                           type_="authentication_error", code="invalid_api_key") from None
        return principal.name

    async def _json(self, request: web.Request) -> Any:
        return await read_json(request, self.max_request_bytes)

    @staticmethod
    def _session_id(request: web.Request) -> str | None:
        session = request.match_info.get("session") or request.headers.get(SESSION_HEADER)
        if session is not None and not (0 < len(session) <= 200):
            raise ApiError(400, "a session id must have 1 to 200 characters", param="session")
        return session

    def _policy(self, session_id: str | None) -> PolicyClient:
        if len(self.policies) == 1:  # spares each call the hash below
            return self.policies[0]
        if session_id is None:
            return self.policies[next(self._turns) % len(self.policies)]
        return self.policies[int(uuid.uuid5(uuid.NAMESPACE_URL, session_id)) % len(self.policies)]

    # -- routes -------------------------------------------------------------------------------

    async def _health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "sessions": len(self.store.sessions),
                                  "expired_sessions": self.store.expired, "held_records": self.held_records,
                                  "released_records": self.released_records})

    async def _models(self, request: web.Request) -> web.Response:
        self._principal(request, AuthRole.AGENT)
        names = self.model_names + [name for name in await self._adapter_names() if name not in self.model_names]
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "sciproto"} for name in names]})

    async def _adapter_names(self) -> list[str]:
        """The LoRA adapters the policy servers hold now, by name (those of the first server, as
        every server of a gateway gets the same pushes)."""
        described = await self.policies[0].describe(timeout_s=10.0)
        names = [serving.adapter.name for serving in described.adapters]
        self._known_adapters.update(names)
        return names

    async def _route(self, model: str) -> str:
        """The adapter a call's `model` samples with, or a 404 listing the names served."""
        if model in self.model_names:
            return self.adapter
        if model in self._known_adapters:
            return model
        adapters = await self._adapter_names()
        if model in adapters:
            return model
        raise ApiError(404, f"the model {model!r} does not exist here; this gateway serves "
                       f"{', '.join(self.model_names + adapters)} (GET /v1/models)", param="model",
                       code="model_not_found")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._call(request, parse_chat_request, self._complete)

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._call(request, parse_responses_request, self._respond)
        except SciprotoError as error:  # a policy server's refusal, in the Responses API's names
            raise as_responses_error(from_sciproto(error)) from None

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        """Anthropic's Messages API: its errors in its own shape."""
        try:
            return await self._call(request, parse_messages_request, self._message)
        except ApiError as error:
            return anthropic_error(error)
        except SciprotoError as error:
            return anthropic_error(from_sciproto(error))

    async def _call(self, request: web.Request, parse: Callable[[Any, int], ChatCall],
                    answer: Callable[..., Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        principal = self._principal(request, AuthRole.AGENT)
        call = parse(await self._json(request), self.max_context_tokens)
        call.adapter = await self._route(call.model)
        session_id = self._session_id(request)
        if session_id is None:
            return await answer(request, call, None, Plan([], "", None), self._policy(None))
        session = self.store.open(session_id, principal)
        async with session.lock:
            self.store.check_size(session)
            try:
                return await answer(request, call, session, session.plan(call), self._policy(session_id))
            finally:
                self.store.touch(session)  # idle from the call's end: a call longer than the TTL keeps it

    async def _start(self, call: ChatCall, plan: Plan, policy: PolicyClient, session: Session | None
                     ) -> tuple[AsyncIterator[policy_pb2.GenerateResponse], policy_pb2.GeneratePrompt, str]:
        """Open the Generate stream and read its prompt event. When the server cannot extend the
        previous tokens (a chat template that does not render the history as a prefix), the call
        starts a new segment instead and says why.

        In a session the call's completions are capped to what its token limit has left: the
        first try asks for what is left after the previous tokens; when the prompt turns out
        longer, the stream is dropped at its prompt event (before any token is kept) and sent
        again with the exact room, so no call takes a session past --max-session-tokens."""
        reason = plan.reason
        previous = plan.previous_token_ids
        budget = self.store.limits.max_tokens - session.tokens if session is not None else None
        sent = call if budget is None else self._capped(call, session, budget - len(previous), previous)
        while True:
            events = policy.generate(sent.generate_request(previous, f"gw-{uuid.uuid4().hex[:16]}"),
                                     self.generate_timeout_s)
            try:
                first = await anext(events)
            except InvalidArgument as error:
                await events.aclose()
                if not previous or error.reason == Reason.PROMPT_TOO_LONG:
                    raise
                reason, previous = f"the policy server could not extend the previous tokens: {error.message}", []
                continue
            except StopAsyncIteration:
                raise ApiError(502, "the policy server ended Generate without a prompt event",
                               type_="server_error") from None
            if first.WhichOneof("event") != "prompt":
                await events.aclose()
                raise ApiError(502, "the policy server's Generate did not start with its prompt", type_="server_error")
            if budget is not None and session is not None:
                room = budget - len(first.prompt.token_ids)
                most = self.max_context_tokens - len(first.prompt.token_ids)  # a completion's most tokens
                if room < sent.n * min(sent.max_tokens or most, most):
                    await events.aclose()
                    sent = self._capped(call, session, room, first.prompt.token_ids)
                    continue
            return events, first.prompt, reason

    def _capped(self, call: ChatCall, session: Session, room: int, prompt: Any) -> ChatCall:
        """`call` with its completions fitted into `room` tokens of the session's limit, or the
        refusal when not one token per sample fits."""
        per_sample = room // call.n
        if per_sample < 1:
            raise ApiError(400, f"session {session.id!r} has recorded {session.tokens} tokens and this call's prompt "
                           f"has at least {len(prompt)}, which leaves no room under the session's limit of "
                           f"{self.store.limits.max_tokens} tokens (--max-session-tokens); close it and start "
                           "another", param="session", code="session_too_large")
        if (call.max_tokens or self.max_context_tokens) <= per_sample:
            return call  # its completions fit whatever the prompt: the context bounds them too
        return dataclasses.replace(call, max_tokens=min(call.max_tokens or per_sample, per_sample))

    async def _complete(self, request: web.Request, call: ChatCall, session: Session | None, plan: Plan,
                        policy: PolicyClient) -> web.StreamResponse:
        events, prompt, reason = await self._start(call, plan, policy, session)
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = now()
        with_tools = bool(call.tools)
        try:
            if call.stream:
                response, samples = await stream_chat(request, call, events, completion_id, created,
                                                       len(prompt.token_ids), with_tools)
            else:
                samples = [event.sample async for event in events if event.WhichOneof("event") == "sample"]
                response = None
        finally:
            await events.aclose()
        choices = [Choice(s.sample_index, s, with_tools) for s in sorted(samples, key=lambda s: s.sample_index)]
        if session is not None and len(choices) == call.n:
            session.record(call, plan, reason, list(prompt.token_ids), prompt.policy_version, choices)
        if response is not None:
            return response
        return web.json_response(completion_object(completion_id, call.model, created, choices,
                                                   len(prompt.token_ids), call.logprobs))

    async def _respond(self, request: web.Request, call: ChatCall, session: Session | None, plan: Plan,
                       policy: PolicyClient) -> web.StreamResponse:
        """A Responses API answer: one sample, as output items; streamed as its typed events."""
        response_id, created, with_tools = f"resp_{uuid.uuid4().hex}", now(), bool(call.tools)
        return await self._one_sample(
            call, session, plan, policy,
            stream=lambda events, prompt_tokens: stream_response(request, call, events, response_id, created,
                                                                 prompt_tokens, with_tools),
            answer=lambda choice, prompt_tokens: response_object(response_id, call.model, created, choice,
                                                                 prompt_tokens))

    async def _message(self, request: web.Request, call: ChatCall, session: Session | None, plan: Plan,
                       policy: PolicyClient) -> web.StreamResponse:
        """A Messages API answer: one sample, as content blocks; streamed as its events."""
        message_id, with_tools = new_message_id(), bool(call.tools)
        return await self._one_sample(
            call, session, plan, policy,
            stream=lambda events, prompt_tokens: stream_message(request, call, events, message_id, prompt_tokens,
                                                                with_tools),
            answer=lambda choice, prompt_tokens: message_object(message_id, call.model, choice, prompt_tokens))

    async def _one_sample(self, call: ChatCall, session: Session | None, plan: Plan, policy: PolicyClient,
                          stream: Callable[[Any, int], Awaitable[tuple[web.StreamResponse, Any]]],
                          answer: Callable[[Choice, int], dict[str, Any]]) -> web.StreamResponse:
        """Generate one sample for an API that answers with one (Responses, Messages): streamed by
        `stream(events, prompt_tokens)` or answered whole as `answer(choice, prompt_tokens)`, and
        recorded in the session either way."""
        events, prompt, reason = await self._start(call, plan, policy, session)
        response: web.StreamResponse | None = None
        sample = None
        try:
            if call.stream:
                response, sample = await stream(events, len(prompt.token_ids))
            else:
                async for event in events:
                    if event.WhichOneof("event") == "sample":
                        sample = event.sample
        finally:
            await events.aclose()
        choice = Choice(0, sample, bool(call.tools)) if sample is not None else None
        if session is not None and choice is not None:
            session.record(call, plan, reason, list(prompt.token_ids), prompt.policy_version, [choice])
        if response is not None:
            return response
        if choice is None:
            raise ApiError(502, "the policy server ended Generate without its sample", type_="server_error")
        return web.json_response(answer(choice, len(prompt.token_ids)))

    async def _session(self, request: web.Request) -> web.Response:
        principal = self._principal(request, AuthRole.AGENT)
        return web.json_response(self.store.get(request.match_info["session"], principal).to_json())

    async def _close(self, request: web.Request) -> web.Response:
        """Close a session with its outcome. Giving a reward is grading: it needs role grader."""
        principal = self._principal(request, AuthRole.AGENT)
        body = await self._json(request)
        outcome = _outcome(body)
        if outcome.status is RolloutStatus.SCORED:
            self._principal(request, AuthRole.GRADER, charge=False)
        session_id = request.match_info["session"]
        session, records = await self.close_session(session_id, principal, outcome)
        return web.json_response({"session": session_id, "group": task_for_label(outcome.group).group_id,
                                  "records": len(records), "segments": session.segments,
                                  "rollout_ids": [r.rollout_id for r in records]})

    async def close_session(self, session_id: str, principal: str, outcome: Outcome
                            ) -> tuple[Session, list[RolloutRecord]]:
        """End a session: its records join `outcome.group` (and the rollouts file)."""
        session = self.store.get(session_id, principal)
        async with session.lock:
            if session.calls:
                self._check_room(session.segments)
            self.store.pop(session_id, principal)
        if not session.calls:
            raise ApiError(400, f"session {session_id!r} made no call; nothing to train on", code="empty_session")
        return session, self._add(outcome, lambda first: session_records(session, outcome, first))

    def record_failure(self, session_id: str, outcome: Outcome) -> RolloutRecord:
        """Account for a session that failed before its first call (an INFRA_ERROR record)."""
        return self._add(outcome, lambda first: [failed_record(session_id, outcome, first)])[0]

    def _add(self, outcome: Outcome, build: Callable[[int], list[RolloutRecord]]) -> list[RolloutRecord]:
        first = self._next_sample.get(outcome.group, 0)
        records = build(first)
        self._next_sample[outcome.group] = first + 1  # a session is one sample, whatever its segments
        if self.rollouts_file is not None:
            with self.rollouts_file.open("a", encoding="utf-8") as file:
                file.writelines(record.to_json_line() for record in records)
        self.groups.setdefault(outcome.group, []).extend(records)
        self.held_records += len(records)
        self._release_oldest()
        return records

    def _check_room(self, records: int) -> None:
        """Refuse a close whose records would pass the bound on held records when they exist
        nowhere else (no rollouts file): the session stays open, nothing is lost."""
        limit = self.store.limits.max_held_records
        if self.rollouts_file is None and self.held_records and self.held_records + records > limit:
            raise ApiError(429, f"the gateway holds {self.held_records} closed records no one has taken (its "
                           f"limit is {limit}); take finished groups (POST /groups/LABEL/take) and close again, "
                           "or serve with --rollouts to keep records in a file", type_="rate_limit_error",
                           code="too_many_held_records", retry_after_s=1.0)

    def _release_oldest(self) -> None:
        """With a rollouts file, the oldest records past the bound leave memory (counted)."""
        limit = self.store.limits.max_held_records
        while self.rollouts_file is not None and self.held_records > limit:
            label, records = next(iter(self.groups.items()))
            dropped = records.pop(0)
            if not records:
                del self.groups[label]
            self.held_records -= 1
            self.released_records += 1
            self.released[label] = self.released.get(label, 0) + 1
            log.warning("released %s from memory past %d held records; it is in %s", dropped.rollout_id, limit,
                        self.rollouts_file)

    def take(self, label: str, *, last: bool = False) -> tuple[list[RolloutRecord], int]:
        """The records of group `label` closed so far, handed over once, and how many of its
        records were released from memory before (they are in the rollouts file). `last`: no
        session will close in this group again, so its numbering is forgotten too."""
        if last:
            self._next_sample.pop(label, None)
        records = self.groups.pop(label, [])
        self.held_records -= len(records)
        return records, self.released.pop(label, 0)

    async def _take(self, request: web.Request) -> web.Response:
        self._principal(request, AuthRole.TRAINER)
        label = request.match_info["label"]
        records, released = self.take(label)
        return web.json_response({"group": task_for_label(label).group_id, "released": released,
                                  "records": [r.model_dump(mode="json", by_alias=True) for r in records]})


def _outcome(body: Any) -> Outcome:
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object: {\"group\": str, \"reward\": float}", param="body")
    group = body.get("group")
    if not isinstance(group, str) or not group or len(group) > 200:
        raise ApiError(400, "group is required: the label shared by the sessions of one task (e.g. "
                       "\"gsm8k/train/3\")", param="group")
    try:
        status = RolloutStatus(body.get("status", "SCORED"))
    except ValueError:
        raise ApiError(400, "status must be SCORED, UNSCORED or INFRA_ERROR", param="status") from None
    reward = body.get("reward")
    if status is RolloutStatus.SCORED and (isinstance(reward, bool) or not isinstance(reward, int | float)):
        raise ApiError(400, "reward (a number) is required for a SCORED session", param="reward")
    error = body.get("error")
    if status is RolloutStatus.INFRA_ERROR and not (isinstance(error, str) and error):
        raise ApiError(400, "an INFRA_ERROR session needs `error`: what failed", param="error")
    task = body.get("task") or {}
    if not isinstance(task, dict) or not all(isinstance(v, str) for v in task.values()):
        raise ApiError(400, "task must map names to strings", param="task")
    return Outcome(group, float(reward or 0.0), status, error if isinstance(error, str) else None, task)
