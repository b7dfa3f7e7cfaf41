"""Bounds on one request: its body is refused past `max_request_bytes` before it is read whole (a
Content-Length past the limit at once; a chunked body as soon as it passes it), with OpenAI's
error shape and status 413."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from gateway.errors import ApiError

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "read_json", "too_large"]

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024


def too_large(size: int | None, limit: int) -> ApiError:
    said = f"is {size} bytes" if size is not None else f"passed {limit} bytes"
    return ApiError(413, f"the request body {said}; this gateway takes at most {limit} bytes: send a shorter "
                    "conversation, or raise the limit (`sciproto serve gateway --max-request-bytes`)",
                    param="body", code="request_too_large")


async def read_json(request: web.Request, limit: int) -> Any:
    """The request's JSON body, read only when it is within `limit` bytes."""
    if request.content_length is not None and request.content_length > limit:
        raise too_large(request.content_length, limit)
    try:
        raw = await request.read()  # aiohttp stops reading past the app's client_max_size (= limit)
    except web.HTTPRequestEntityTooLarge:
        raise too_large(None, limit) from None
    if len(raw) > limit:
        raise too_large(len(raw), limit)
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(400, f"the body is not JSON: {error}", param="body") from None
