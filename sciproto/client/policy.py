"""Async client of PolicyService: Describe, streaming Generate, pushing weights, and holding
generation.

    async with PolicyClient("127.0.0.1:50052") as policy:
        group = await policy.generate_group(generate_request(prompt_token_ids=[1, 2, 3], n=4))
        async with policy.hold(reason="learner step") as window:  # no forward pass runs in here
            await policy.push_weights(model.state_dict(), version=1)

Failures surface as `sciproto.errors.SciprotoError` subclasses carrying the server's reason.
Requests carry the current span in their trace_context. Only pushing weights needs torch, which
is imported then: a rollout client that only samples never loads it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

import grpc

from sciproto.channel import ChannelConfig, make_channel
from sciproto.client.protocol import check_protocol
from sciproto.errors import from_rpc_error
from sciproto.pb import common_pb2, policy_grpc, policy_pb2
from sciproto.sampling import UNTRANSFORMED, Distribution, distribution_from_pb
from sciproto.tracing import current_trace_context
from sciproto.units import MiB

if TYPE_CHECKING:
    import torch

UPDATE_WEIGHTS = "/sciproto.v1.PolicyService/UpdateWeights"


def text_only(message: common_pb2.ChatMessage) -> common_pb2.ChatMessage:
    """`message` without its typed parts: its text (`content`) alone, for a model that takes
    text only (a policy server refuses image parts it cannot see)."""
    if not message.parts:
        return message
    plain = common_pb2.ChatMessage()
    plain.CopyFrom(message)
    plain.ClearField("parts")
    return plain


def generate_request(
    *,
    messages: Sequence[common_pb2.ChatMessage] = (),
    tools: Sequence[common_pb2.ToolSpec] = (),
    previous_token_ids: Sequence[int] = (),
    prompt_token_ids: Sequence[int] = (),
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    max_tokens: int = 0,
    stop: Sequence[str] = (),
    seed: int | None = None,
    n: int = 1,
    request_id: str = "",
    adapter: str = "",
) -> policy_pb2.GenerateRequest:
    """A GenerateRequest from chat `messages` (+ tools, previous turn's ids) or `prompt_token_ids`.
    None leaves temperature / top_p / top_k / seed unset (the defaults of sciproto.sampling; the
    server's choice of seed). `adapter` names the LoRA adapter to sample with ("": the base)."""
    if bool(messages) == bool(prompt_token_ids):
        raise ValueError("give either messages or prompt_token_ids, not both and not neither")
    sampling = policy_pb2.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                                         stop=list(stop), seed=seed)
    request = policy_pb2.GenerateRequest(request_id=request_id, sampling=sampling, n=n, adapter=adapter,
                                         trace_context=current_trace_context())
    if messages:
        request.chat.CopyFrom(policy_pb2.ChatPrompt(messages=messages, tools=tools,
                                                    previous_token_ids=previous_token_ids))
    else:
        request.tokens.CopyFrom(policy_pb2.TokenPrompt(token_ids=prompt_token_ids))
    return request


@dataclass
class GenerationGroup:
    """The outcome of one Generate call: the prompt as the model saw it and its n samples."""

    prompt_token_ids: list[int]
    policy_version: int  # at the start of sampling; each sample's version_spans are exact
    samples: list[policy_pb2.GenerateSample]  # ordered by sample_index
    # The distribution the samples were drawn from: the request's temperature, top_p and top_k,
    # which the server applies or refuses (sciproto/sampling.py).
    sampling: Distribution = UNTRANSFORMED


@dataclass
class HoldWindow:
    """One hold, in the server's wall clock: from `held_at` (the engine idle) to `released_at`
    (generation allowed again; 0 until the hold has ended), and why it ended."""

    held_at: float
    requests_held: int
    released_at: float = 0.0
    release_reason: str = ""


class PolicyClient:
    """A client of one policy server. Built from a channel it does not own, or from a
    ChannelConfig / "HOST:PORT" whose channel it opens and closes."""

    def __init__(self, channel_or_config: grpc.aio.Channel | ChannelConfig | str) -> None:
        self._owns_channel = not isinstance(channel_or_config, grpc.aio.Channel)
        self.target = (channel_or_config.target if isinstance(channel_or_config, ChannelConfig)
                       else channel_or_config if isinstance(channel_or_config, str) else "")
        self.channel = make_channel(channel_or_config) if self._owns_channel else channel_or_config
        self._stub = policy_grpc.PolicyServiceStub(self.channel)
        self._update_weights: Any = None  # made by the first push_weights (it needs torch)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._owns_channel:
            await self.channel.close()

    async def describe(self, timeout_s: float | None = None) -> policy_pb2.PolicyServiceDescribeResponse:
        """The server's Describe; FailedPrecondition (INCOMPATIBLE_PROTOCOL) when it speaks
        another major protocol version (sciproto.client.protocol)."""
        try:
            request = policy_pb2.PolicyServiceDescribeRequest(trace_context=current_trace_context())
            described = await self._stub.Describe(request, timeout=timeout_s)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from error
        check_protocol(described.server, "policy", self.target)
        return described

    async def generate(self, request: policy_pb2.GenerateRequest,
                       timeout_s: float | None = None) -> AsyncIterator[policy_pb2.GenerateResponse]:
        """The stream's events: the prompt, deltas, one sample per n. Leaving the loop early
        cancels the call, and the server stops sampling for it. A request without a
        trace_context gets the current span's."""
        if not request.HasField("trace_context"):
            request.trace_context.CopyFrom(current_trace_context())
        call = self._stub.Generate(request, timeout=timeout_s)
        try:
            async for event in call:
                yield event
        except grpc.RpcError as error:
            raise from_rpc_error(error) from error
        finally:
            call.cancel()  # no-op when the stream already ended

    async def generate_group(self, request: policy_pb2.GenerateRequest,
                             timeout_s: float | None = None) -> GenerationGroup:
        """Run one Generate to the end and collect its prompt and samples."""
        prompt: policy_pb2.GeneratePrompt | None = None
        samples: list[policy_pb2.GenerateSample] = []
        async for event in self.generate(request, timeout_s):
            kind = event.WhichOneof("event")
            if kind == "prompt":
                prompt = event.prompt
            elif kind == "sample":
                samples.append(event.sample)
        if prompt is None:
            raise RuntimeError("the Generate stream ended without its prompt event; is the server a sciproto "
                               "policy server?")
        samples.sort(key=lambda sample: sample.sample_index)
        return GenerationGroup(list(prompt.token_ids), prompt.policy_version, samples,
                               distribution_from_pb(request.sampling))

    @contextlib.asynccontextmanager
    async def hold(self, max_seconds: float = 0.0, reason: str = "",
                   timeout_s: float = 120.0) -> AsyncIterator[HoldWindow]:
        """Hold the server's generation for the block (PolicyService.Hold, protocol 1.5): entered
        once the engine is idle, released on leaving (the window's `released_at` is set then), at
        the latest after `max_seconds` (0: the server's limit). `timeout_s` bounds each wait for the
        server's answer; a block left by an error or a cancel releases the hold by cancelling it."""
        call = self._stub.Hold()
        released = False
        try:
            await asyncio.wait_for(call.write(policy_pb2.HoldRequest(max_seconds=max_seconds, reason=reason)),
                                   timeout_s)
            first = await asyncio.wait_for(call.read(), timeout_s)
            if first is grpc.aio.EOF or first.state != policy_pb2.HOLD_STATE_HELD:
                raise RuntimeError(f"the Hold call of {self.target} answered without holding ({first!r})")
            window = HoldWindow(first.held_at_unix_s, first.requests_held)
            yield window
            await asyncio.wait_for(call.done_writing(), timeout_s)
            last = await asyncio.wait_for(call.read(), timeout_s)
            if last is not grpc.aio.EOF:
                window.released_at, window.release_reason = last.released_at_unix_s, last.release_reason
            released = True
        except grpc.RpcError as error:
            raise from_rpc_error(error) from error
        finally:
            if not released:
                call.cancel()  # the server releases a cancelled hold

    async def push_weights(self, state_dict: Mapping[str, torch.Tensor], version: int,
                           chunk_bytes: int = 4 * MiB, timeout_s: float | None = None,
                           request_id: str = "", provenance: policy_pb2.WeightsProvenance | None = None,
                           digests: Sequence[bytes] | None = None,
                           adapter: policy_pb2.LoraAdapter | None = None) -> policy_pb2.UpdateWeightsResponse:
        """Send every tensor of `state_dict` (the model's full parameter set, in any order) as
        policy `version`. Chunks are cut from the tensors as the stream drains; the model is never
        copied whole. A tensor that shares storage with an earlier one (tied embeddings, as in
        `state_dict()`) is sent once, under the earlier name, as the server's manifest lists it.
        `provenance` (model id, run id, `weights_sha256` of the tensors) and `digests`
        (`tensor_digests` of `distinct_tensors(state_dict)`: each tensor's XXH3-128, which the
        server checks and then reports in Describe) are checked by the server before it swaps.
        With `adapter` (sciproto.lora.LoraSpec.to_proto()), `state_dict` is that LoRA adapter's
        tensors as PEFT names them, and `version` the adapter's version (protocol 1.4)."""
        from sciproto.weights.wire import (
            chunk_parts,
            data_message_wire,
            header_for,
            serialize_request,
        )

        if self._update_weights is None:
            # UpdateWeights with data chunks written straight to the wire (see data_message_wire)
            self._update_weights = self.channel.stream_unary(
                UPDATE_WEIGHTS, request_serializer=serialize_request,
                response_deserializer=policy_pb2.UpdateWeightsResponse.FromString)
        state_dict = distinct_tensors(state_dict)
        header = header_for(state_dict, version, request_id, digests)
        header.trace_context.CopyFrom(current_trace_context())
        if provenance is not None:
            header.provenance.MergeFrom(provenance)
        if adapter is not None:
            header.adapter.CopyFrom(adapter)

        async def messages() -> AsyncIterator[policy_pb2.UpdateWeightsRequest | bytes]:
            yield policy_pb2.UpdateWeightsRequest(header=header)
            for parts in chunk_parts(state_dict, chunk_bytes):
                yield data_message_wire(parts)

        try:
            return await self._update_weights(messages(), timeout=timeout_s)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from error


def distinct_tensors(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state_dict` without the entries that alias an earlier entry's memory."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    distinct = {}
    for name, tensor in state_dict.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if tensor.numel() == 0 or key not in seen:  # empty tensors own no memory to alias
            seen.add(key)
            distinct[name] = tensor
    return distinct


async def push_weights_to_all(clients: Iterable[PolicyClient], state_dict: Mapping[str, torch.Tensor],
                              version: int, chunk_bytes: int = 4 * MiB,
                              timeout_s: float | None = None, digests: Sequence[bytes] | None = None
                              ) -> list[policy_pb2.UpdateWeightsResponse]:
    """Push the same weights to several servers concurrently; raises the first failure after all
    pushes have ended (a server that failed keeps its old weights)."""
    results = await asyncio.gather(
        *(client.push_weights(state_dict, version, chunk_bytes, timeout_s, digests=digests) for client in clients),
        return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return list(results)  # type: ignore[arg-type]
