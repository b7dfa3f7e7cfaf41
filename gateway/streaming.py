"""Server-sent events: a chat completion's chunks, and a Responses answer's typed events, as
Generate's stream gives its deltas and samples."""

from __future__ import annotations

import itertools
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web

from gateway.chat import ChatCall, Choice, chunk_object, logprob_entries
from gateway.chat import usage as usage_object
from gateway.errors import from_sciproto
from gateway.responses import output_items, response_object
from sciproto.errors import SciprotoError
from sciproto.pb import policy_pb2

__all__ = ["one_sample", "open_event_stream", "stream_chat", "stream_response"]


async def open_event_stream(request: web.Request) -> web.StreamResponse:
    """A server-sent-events answer to `request`, its headers sent."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    return response


async def one_sample(events: AsyncIterator[policy_pb2.GenerateResponse], with_tools: bool,
                     on_text: Callable[[str], Awaitable[None]]) -> policy_pb2.GenerateSample | None:
    """The sample of a one-sample Generate stream (None when it ends without one). Without tools
    its text deltas go to `on_text` as they are sampled; with tools the text waits for the
    sample's end, when its tool-call markup has been parsed. A policy server's error is raised."""
    sample = None
    async for event in events:
        kind = event.WhichOneof("event")
        if kind == "delta" and not with_tools and event.delta.text:
            await on_text(event.delta.text)
        elif kind == "sample":
            sample = event.sample
    return sample


async def stream_chat(request: web.Request, call: ChatCall, events: AsyncIterator[policy_pb2.GenerateResponse],
                  completion_id: str, created: int, prompt_tokens: int, with_tools: bool
                  ) -> tuple[web.StreamResponse, list[policy_pb2.GenerateSample]]:
    """Server-sent events: text deltas as they are sampled. With tools, a sample's text waits
    for its end, when its tool-call markup has been parsed into `tool_calls`."""
    response = await open_event_stream(request)

    async def send(payload: dict[str, Any]) -> None:
        await response.write(f"data: {json.dumps(payload)}\n\n".encode())

    def chunk(choices: list[dict[str, Any]], usage_: dict[str, int] | None = None) -> dict[str, Any]:
        return chunk_object(completion_id, call.model, created, choices, usage_)

    samples: list[policy_pb2.GenerateSample] = []
    try:
        await send(chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                           "logprobs": None} for i in range(call.n)]))
        async for event in events:
            kind = event.WhichOneof("event")
            if kind == "delta" and not with_tools:
                delta = event.delta
                logprobs = {"content": logprob_entries(delta.token_ids, delta.logprobs)} if call.logprobs else None
                await send(chunk([{"index": delta.sample_index, "delta": {"content": delta.text},
                                   "finish_reason": None, "logprobs": logprobs}]))
            elif kind == "sample":
                sample = event.sample
                samples.append(sample)
                choice = Choice(sample.sample_index, sample, with_tools)
                if with_tools:
                    delta: dict[str, Any] = {"content": choice.content} if choice.content else {}
                    if choice.tool_calls:
                        delta["tool_calls"] = [{"index": j, **c} for j, c in enumerate(choice.tool_calls)]
                    logprobs = choice.logprobs() if call.logprobs else None
                    if delta or logprobs:
                        await send(chunk([{"index": choice.index, "delta": delta, "finish_reason": None,
                                           "logprobs": logprobs}]))
                await send(chunk([{"index": choice.index, "delta": {}, "finish_reason": choice.finish_reason,
                                   "logprobs": None}]))
        if call.include_usage:
            choices = [Choice(s.sample_index, s, with_tools) for s in samples]
            await send(chunk([], usage_object(prompt_tokens, choices)))
    except SciprotoError as error:
        await send(from_sciproto(error).body())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response, samples


async def stream_response(request: web.Request, call: ChatCall,
                           events: AsyncIterator[policy_pb2.GenerateResponse], response_id: str, created: int,
                           prompt_tokens: int, with_tools: bool
                           ) -> tuple[web.StreamResponse, policy_pb2.GenerateSample | None]:
    response = await open_event_stream(request)
    sequence = itertools.count()

    async def send(kind: str, **payload: Any) -> None:
        data = {"type": kind, "sequence_number": next(sequence), **payload}
        await response.write(f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode())

    message_id = f"msg_{uuid.uuid4().hex}"
    opened = False

    async def open_message() -> None:
        nonlocal opened
        if not opened:
            opened = True
            await send("response.output_item.added", output_index=0, item={
                "type": "message", "id": message_id, "status": "in_progress", "role": "assistant", "content": []})
            await send("response.content_part.added", item_id=message_id, output_index=0, content_index=0,
                       part={"type": "output_text", "text": "", "annotations": []})

    async def text_delta(text: str) -> None:
        await open_message()
        await send("response.output_text.delta", item_id=message_id, output_index=0, content_index=0, delta=text,
                   logprobs=[])

    await send("response.created", response=response_object(response_id, call.model, created, None,
                                                             prompt_tokens, status="in_progress"))
    try:
        sample = await one_sample(events, with_tools, text_delta)
    except SciprotoError as error:
        await send("error", **from_sciproto(error).body()["error"])
        sample = None
    if sample is None:
        await response.write_eof()
        return response, None
    choice = Choice(0, sample, with_tools)
    items = output_items(choice)
    for index, item in enumerate(items):
        if item["type"] == "message":
            item["id"] = message_id
            text = item["content"][0]["text"]
            if not opened and text:
                await open_message()
                await send("response.output_text.delta", item_id=message_id, output_index=index,
                           content_index=0, delta=text, logprobs=[])
            await open_message()
            await send("response.output_text.done", item_id=message_id, output_index=index, content_index=0,
                       text=text, logprobs=[])
            await send("response.content_part.done", item_id=message_id, output_index=index, content_index=0,
                       part=item["content"][0])
        else:
            await send("response.output_item.added", output_index=index, item={**item, "arguments": "",
                                                                                "status": "in_progress"})
            await send("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                       delta=item["arguments"])
            await send("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                       arguments=item["arguments"])
        await send("response.output_item.done", output_index=index, item=item)
    final = response_object(response_id, call.model, created, choice, prompt_tokens, items)
    await send("response.completed" if final["status"] == "completed" else "response.incomplete", response=final)
    await response.write_eof()
    return response, sample
