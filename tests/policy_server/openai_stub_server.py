"""A small OpenAI-compatible HTTP server with fixed, deterministic answers, run as its own process
by the openai backend tests: `python openai_stub_server.py` prints `PORT <n>` once it listens.

Streaming SSE on /v1/chat/completions and /v1/completions, with logprobs and (when
`return_token_ids` is asked) token ids like vLLM. The model name picks a behaviour:
- "stub": answers; a chat request with tools gets a tool call, split over two chunks;
- "busy-<k>": the first k requests of that model get HTTP 503 with Retry-After 0, then "stub";
- "hang": accepts the request and never answers.
GET /stats gives the number of requests per model.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections import Counter

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

CHAT_PIECES = ["The answer", " is", " 4."]
TOOL_ARGUMENT_PIECES = ['{"expression": ', '"2+2"}']
requests_by_model: Counter[str] = Counter()


def _token_ids(text: str) -> list[int]:
    return list(text.encode())  # one "token" per byte: deterministic and easy to check


def _logprobs(text: str) -> list[float]:
    return [-0.01 * (i + 1) for i in range(len(_token_ids(text)))]


def _sse(chunks: list[dict]) -> StreamingResponse:
    async def events():
        for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def _admit(request: Request) -> tuple[dict, Response | None]:
    body = await request.json()
    model = body.get("model", "")
    requests_by_model[model] += 1
    if model == "hang":
        await asyncio.sleep(3600)
    if model.startswith("busy-") and requests_by_model[model] <= int(model.removeprefix("busy-")):
        return body, JSONResponse({"error": "busy"}, status_code=503, headers={"Retry-After": "0"})
    return body, None


async def chat_completions(request: Request) -> Response:
    body, refusal = await _admit(request)
    if refusal is not None:
        return refusal
    with_ids = body.get("return_token_ids", False)
    chunks = []
    for index in range(body.get("n", 1)):
        pieces = [f"{piece}" for piece in CHAT_PIECES]
        for position, piece in enumerate(pieces):
            choice: dict = {"index": index, "delta": {"content": piece}, "finish_reason": None,
                            "logprobs": {"content": [{"token": "x", "logprob": value, "top_logprobs": []}
                                                     for value in _logprobs(piece)]}}
            if with_ids:
                choice["token_ids"] = _token_ids(piece)
            chunk = {"object": "chat.completion.chunk", "choices": [choice]}
            if with_ids and position == 0 and index == 0:
                chunk["prompt_token_ids"] = [1, 2, 3]
            chunks.append(chunk)
        if body.get("tools"):
            name = body["tools"][0]["function"]["name"]
            for position, arguments in enumerate(TOOL_ARGUMENT_PIECES):
                call = {"index": 0, "function": {"arguments": arguments}}
                if position == 0:
                    call |= {"id": f"call_{index}", "type": "function"}
                    call["function"]["name"] = name
                chunks.append({"choices": [{"index": index, "delta": {"tool_calls": [call]}, "finish_reason": None}]})
        finish = "tool_calls" if body.get("tools") else "stop"
        chunks.append({"choices": [{"index": index, "delta": {}, "finish_reason": finish}]})
    return _sse(chunks)


async def completions(request: Request) -> Response:
    body, refusal = await _admit(request)
    if refusal is not None:
        return refusal
    prompt = body["prompt"]
    text = "ok " * min(body.get("max_tokens", 16), 3)
    finish = "length" if body.get("max_tokens", 16) <= 3 else "stop"
    chunks = []
    for index in range(body.get("n", 1)):
        choice = {"index": index, "text": text, "finish_reason": None,
                  "logprobs": {"tokens": list(text), "token_logprobs": _logprobs(text)}}
        if body.get("return_token_ids"):
            choice |= {"token_ids": _token_ids(text), "prompt_token_ids": prompt}
        chunks += [{"choices": [choice]}, {"choices": [{"index": index, "text": "", "finish_reason": finish}]}]
    return _sse(chunks)


async def stats(request: Request) -> Response:
    return JSONResponse(dict(requests_by_model))


app = Starlette(routes=[
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/stats", stats),
])

if __name__ == "__main__":
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    print(f"PORT {listener.getsockname()[1]}", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[listener])
