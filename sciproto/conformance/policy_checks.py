"""Conformance checks of a PolicyService, over the wire.

The Generate stream's shape (prompt first, deltas, one sample per n with matching token ids,
log-probabilities and version spans), seeded repeatability, stop strings (left out of the text),
multi-turn prompts extending `previous_token_ids`, the documented refusals, deadlines, that a refused weight update leaves
the serving version alone, and (servers listing the `hold` capability, protocol 1.5) that a Generate
waits while a Hold is open and finishes once it is released. Prompts are short and completions a few tokens, so any model will do.
"""

from __future__ import annotations

import asyncio
import uuid

import grpc

from sciproto.channel import ChannelConfig, make_channel
from sciproto.conformance.report import Report
from sciproto.conformance.wire import (
    Check,
    CheckFailed,
    Skipped,
    call_fails,
    call_ok,
    check,
    check_health,
    check_reflection,
    decode_rpc_error,
    expect_error,
    run_checks,
)
from sciproto.pb import POLICY_SERVICE, common_pb2, policy_grpc, policy_pb2

INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT
MAX_TOKENS = 6
HOLD_WAIT_S = 1.0  # how long a Generate must keep waiting while a hold is open


def new_id() -> str:
    return uuid.uuid4().hex


def user(text: str) -> common_pb2.ChatMessage:
    return common_pb2.ChatMessage(role=common_pb2.ROLE_USER, content=text)


def chat_request(messages: list[common_pb2.ChatMessage], *, n: int = 1, seed: int = 7,
                 previous: list[int] | None = None, max_tokens: int = MAX_TOKENS) -> policy_pb2.GenerateRequest:
    return policy_pb2.GenerateRequest(
        request_id=new_id(), chat=policy_pb2.ChatPrompt(messages=messages, previous_token_ids=previous or []),
        sampling=policy_pb2.SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed), n=n)


class Generated:
    """One Generate stream, read whole and checked against the contract's shape."""

    def __init__(self, events: list[policy_pb2.GenerateResponse], n: int) -> None:
        check(events, "Generate sent no events")
        check(events[0].WhichOneof("event") == "prompt", f"the first event is {events[0].WhichOneof('event')}, "
                                                         "not the prompt")
        self.prompt = events[0].prompt
        check(self.prompt.token_ids, "the prompt event carries no token ids")
        deltas: dict[int, list[int]] = {}
        self.samples: dict[int, policy_pb2.GenerateSample] = {}
        for event in events[1:]:
            kind = event.WhichOneof("event")
            check(kind in ("delta", "sample"), f"an event after the first is {kind}")
            if kind == "delta":
                index = event.delta.sample_index
                check(index < n, f"a delta names sample {index} of {n}")
                check(index not in self.samples, f"a delta of sample {index} came after its sample")
                check(len(event.delta.token_ids) == len(event.delta.logprobs),
                      "a delta has a different number of token ids and logprobs")
                deltas.setdefault(index, []).extend(event.delta.token_ids)
            else:
                index = event.sample.sample_index
                check(index not in self.samples, f"sample {index} was sent twice")
                self.samples[index] = event.sample
        check(sorted(self.samples) == list(range(n)), f"samples {sorted(self.samples)} came for n = {n}")
        for index, sample in self.samples.items():
            ids, logprobs = list(sample.completion_token_ids), list(sample.logprobs)
            check(len(ids) == len(logprobs), f"sample {index}: {len(ids)} token ids but {len(logprobs)} logprobs")
            check(all(value <= 1e-4 for value in logprobs), f"sample {index} has a logprob above 0")
            check(deltas.get(index, []) == ids, f"sample {index}: the deltas' tokens are not its completion")
            check(sample.finish_reason != policy_pb2.FINISH_REASON_UNSPECIFIED, f"sample {index} has no finish_reason")
            position = 0
            for span in sample.version_spans:
                check(span.start == position and span.end > span.start,
                      f"sample {index}: version spans do not tile the completion")
                check(span.policy_version >= self.prompt.policy_version,
                      f"sample {index}: a span's version is older than the prompt's")
                position = span.end
            check(position == len(ids), f"sample {index}: version spans cover {position} of {len(ids)} tokens")


class PolicyChecks:
    def __init__(self, channel: grpc.aio.Channel, timeout_s: float) -> None:
        self.channel = channel
        self.stub = policy_grpc.PolicyServiceStub(channel)
        self.timeout_s = timeout_s
        self.described: policy_pb2.PolicyServiceDescribeResponse | None = None

    async def generate(self, request: policy_pb2.GenerateRequest, timeout: float | None = None) -> Generated:
        events = []
        try:
            async for event in self.stub.Generate(request, timeout=timeout or self.timeout_s):
                events.append(event)
        except grpc.aio.AioRpcError as error:
            raise CheckFailed(f"Generate failed: {decode_rpc_error(error)}") from None
        return Generated(events, request.n or 1)

    async def generate_fails(self, request: policy_pb2.GenerateRequest, code: grpc.StatusCode, reason: str) -> None:
        async def drain() -> list[policy_pb2.GenerateResponse]:
            return [event async for event in self.stub.Generate(request, timeout=self.timeout_s)]
        await call_fails(drain(), code, reason)

    async def describe_now(self) -> policy_pb2.PolicyServiceDescribeResponse:
        return await call_ok(self.stub.Describe(policy_pb2.PolicyServiceDescribeRequest(request_id=new_id()),  # type: ignore[return-value]
                                                timeout=self.timeout_s), "Describe")

    # ---------------------------------------------------------------- checks

    async def describe(self) -> str:
        described = await self.describe_now()
        version = described.server.protocol_version
        check(version.split(".")[0] == "1", f"protocol_version {version!r} is not 1.x")
        check(described.max_context_tokens > 0, "max_context_tokens is 0")
        check(described.model, "Describe names no model")
        self.described = described
        return f"protocol {version}, {described.model} on {described.backend}, version {described.policy_version}"

    async def health(self) -> str:
        return await check_health(self.channel, POLICY_SERVICE, self.timeout_s)

    async def reflection(self) -> str:
        return await check_reflection(self.channel, POLICY_SERVICE, self.timeout_s)

    async def generate_stream(self) -> str:
        generated = await self.generate(chat_request([user("Say hello.")], n=2))
        lengths = [len(generated.samples[index].completion_token_ids) for index in range(2)]
        return f"prompt of {len(generated.prompt.token_ids)} tokens, 2 samples of {lengths} tokens"

    async def seeded_repeat(self) -> str:
        request = chat_request([user("Count to three.")], n=2, seed=1234)
        first, again = await self.generate(request), await self.generate(request)
        for index in range(2):
            check(first.samples[index].completion_token_ids == again.samples[index].completion_token_ids,
                  f"the same seed, prompt and weights gave sample {index} different tokens")
        return "same seed, same samples"

    async def stop_strings(self) -> str:
        """SamplingParams.stop: the text ends before the first stop string (it is left out, as in
        OpenAI's API), the sample finishes with STOP, and its tokens are those the same seed
        draws without the stop string, through the token that completed it."""
        request = chat_request([user("Write a few words.")], seed=4321, max_tokens=16)
        whole = (await self.generate(request)).samples[0]
        # A printable ASCII character after the first: a random model also writes pieces of
        # UTF-8 characters, which a text shows as U+FFFD until the character is complete.
        stop = next((c for c in whole.text[1:] if c.isascii() and c.isprintable() and not c.isspace()), None)
        if stop is None:
            raise Skipped(f"the seeded sample {whole.text!r} has no character to stop at")
        request.request_id = new_id()
        request.sampling.stop.append(stop)
        cut = (await self.generate(request)).samples[0]
        expected = whole.text[: whole.text.index(stop)]
        check(cut.text == expected, f"with stop {stop!r} the text is {cut.text!r}; the contract leaves the stop "
                                    f"string out: {expected!r}")
        check(cut.finish_reason == policy_pb2.FINISH_REASON_STOP,
              f"a sample cut by a stop string finished with {policy_pb2.FinishReason.Name(cut.finish_reason)}")
        ids = list(cut.completion_token_ids)
        check(0 < len(ids) <= len(whole.completion_token_ids) and ids == list(whole.completion_token_ids[:len(ids)]),
              "the tokens of a sample cut by a stop string are not the first tokens the same seed draws without it")
        return f"stop {stop!r}: text of {len(cut.text)} characters, ending before it; {len(ids)} tokens"

    async def previous_token_ids(self) -> str:
        first_turn = [user("Name a colour.")]
        first = await self.generate(chat_request(first_turn))
        sample = first.samples[0]
        previous = [*first.prompt.token_ids, *sample.completion_token_ids]
        assistant = common_pb2.ChatMessage(role=common_pb2.ROLE_ASSISTANT, content=sample.content)
        second = await self.generate(chat_request([*first_turn, assistant, user("Another one.")], previous=previous))
        check(list(second.prompt.token_ids[:len(previous)]) == previous,
              "the second turn's prompt does not start with previous_token_ids")
        check(len(second.prompt.token_ids) > len(previous), "the second turn added no tokens for the new message")
        tokens = policy_pb2.GenerateRequest(request_id=new_id(), tokens=policy_pb2.TokenPrompt(token_ids=previous),
                                            sampling=policy_pb2.SamplingParams(max_tokens=2, seed=1), n=1)
        as_tokens = await self.generate(tokens)
        check(list(as_tokens.prompt.token_ids) == previous, "a TokenPrompt was not used as is")
        return f"turn 2 extends {len(previous)} tokens by {len(second.prompt.token_ids) - len(previous)}"

    async def refusals(self) -> str:
        described = self.described or await self.describe_now()
        await self.generate_fails(policy_pb2.GenerateRequest(request_id=new_id()), INVALID_ARGUMENT,
                                  "INVALID_REQUEST")
        outside = policy_pb2.GenerateRequest(request_id=new_id(), tokens=policy_pb2.TokenPrompt(
            token_ids=[2**31]), sampling=policy_pb2.SamplingParams(max_tokens=1))
        await self.generate_fails(outside, INVALID_ARGUMENT, "INVALID_REQUEST")
        valid = list((await self.generate(chat_request([user("Hi.")], max_tokens=1))).prompt.token_ids[:1])
        too_long = policy_pb2.GenerateRequest(request_id=new_id(), tokens=policy_pb2.TokenPrompt(
            token_ids=valid * described.max_context_tokens), sampling=policy_pb2.SamplingParams(max_tokens=1))
        await self.generate_fails(too_long, INVALID_ARGUMENT, "PROMPT_TOO_LONG")
        return "no prompt, a token outside the vocabulary: INVALID_REQUEST; a full context: PROMPT_TOO_LONG"

    async def deadline(self) -> str:
        request = chat_request([user("Write a long story.")], max_tokens=512)
        try:
            async for _ in self.stub.Generate(request, timeout=0.05):
                pass
            outcome = "finished inside 50 ms"
        except grpc.aio.AioRpcError as error:
            check(error.code() == grpc.StatusCode.DEADLINE_EXCEEDED,
                  f"a Generate past its deadline ended with {error.code().name}, not DEADLINE_EXCEEDED")
            outcome = "DEADLINE_EXCEEDED"
        await self.generate(chat_request([user("Hi.")], max_tokens=2))
        return f"{outcome}; the server serves the next request"

    async def refused_update_keeps_weights(self) -> str:
        described = await self.describe_now()
        header = policy_pb2.WeightsHeader(request_id=new_id(), policy_version=described.policy_version + 1,
                                          transport=policy_pb2.WEIGHT_TRANSPORT_GRPC_CHUNKS)

        async def update(messages: list[policy_pb2.UpdateWeightsRequest]) -> object:
            return await self.stub.UpdateWeights(iter(messages), timeout=self.timeout_s)

        if not described.supports_weight_updates:
            await call_fails(update([policy_pb2.UpdateWeightsRequest(header=header)]),
                             grpc.StatusCode.UNIMPLEMENTED, "UNSUPPORTED")
            return "no weight updates: UNIMPLEMENTED/UNSUPPORTED"
        try:
            await update([policy_pb2.UpdateWeightsRequest(data=b"\0" * 8)])
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.PERMISSION_DENIED:
                raise Skipped("the token lacks the trainer role UpdateWeights needs") from None
            expect_error(decode_rpc_error(error), INVALID_ARGUMENT, "INVALID_REQUEST")
        else:
            raise CheckFailed("an UpdateWeights stream starting with data, not a header, was accepted")
        # A header listing no tensors matches no model: refused before any data is read.
        await call_fails(update([policy_pb2.UpdateWeightsRequest(header=header)]), INVALID_ARGUMENT,
                         "INVALID_WEIGHTS")
        after = await self.describe_now()
        check(after.policy_version == described.policy_version,
              f"refused updates moved policy_version {described.policy_version} -> {after.policy_version}")
        await self.generate(chat_request([user("Hi.")], max_tokens=2))
        return "data first: INVALID_REQUEST; an empty manifest: INVALID_WEIGHTS; version unchanged"

    async def hold(self) -> str:
        described = await self.describe_now()
        if "hold" not in described.server.capabilities:
            raise Skipped("the server does not list the hold capability (protocol 1.5)")
        call = self.stub.Hold(timeout=self.timeout_s)
        try:
            await call.write(policy_pb2.HoldRequest(reason="conformance"))
            held = await call.read()
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.PERMISSION_DENIED:
                raise Skipped("the token lacks the trainer role Hold needs") from None
            raise
        check(held is not grpc.aio.EOF and held.state == policy_pb2.HOLD_STATE_HELD,
              f"the first Hold answer is not HOLD_STATE_HELD: {held!r}")
        waiting = asyncio.ensure_future(self.generate(chat_request([user("Hi.")], max_tokens=2)))
        await asyncio.sleep(HOLD_WAIT_S)
        check(not waiting.done(), f"a Generate finished while the hold was open ({HOLD_WAIT_S:g} s)")
        await call.done_writing()
        released = await call.read()
        check(released is not grpc.aio.EOF and released.state == policy_pb2.HOLD_STATE_RELEASED
              and released.release_reason == "released",
              f"the half-close was not answered HOLD_STATE_RELEASED / released: {released!r}")
        check(released.released_at_unix_s >= released.held_at_unix_s == held.held_at_unix_s,
              "released_at_unix_s is before held_at_unix_s, or held_at changed")
        await asyncio.wait_for(waiting, self.timeout_s)
        return (f"a Generate waited {HOLD_WAIT_S:g} s while held and finished after the release"
                f" (held {released.released_at_unix_s - released.held_at_unix_s:.2f} s)")

    def checks(self) -> list[tuple[str, Check]]:
        return [
            ("describe", self.describe),
            ("health", self.health),
            ("reflection", self.reflection),
            ("generate_stream", self.generate_stream),
            ("seeded_generate_repeats", self.seeded_repeat),
            ("stop_strings", self.stop_strings),
            ("previous_token_ids_extend", self.previous_token_ids),
            ("refusals", self.refusals),
            ("deadline", self.deadline),
            ("refused_update_keeps_weights", self.refused_update_keeps_weights),
            ("hold", self.hold),
        ]


async def check_policy(config: ChannelConfig, timeout_s: float = 60.0, only: list[str] | None = None) -> Report:
    """Run the policy checks against `config.target` (a check runs at most `timeout_s`)."""
    report = Report("policy", config.target)
    async with make_channel(config.model_copy(update={"max_attempts": 1})) as channel:
        checks = PolicyChecks(channel, timeout_s)
        selected = [(name, run) for name, run in checks.checks()
                    if only is None or name == "describe" or name in only]
        await run_checks(report, selected, timeout_s)
    return report
