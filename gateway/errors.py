"""OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`, with its HTTP status;
and the mapping from a policy server's gRPC status to it."""

from __future__ import annotations

import math
from typing import Any

import grpc

from sciproto.errors import Reason, SciprotoError

__all__ = ["ApiError", "from_sciproto"]


class ApiError(Exception):
    """An error to answer with: HTTP `status`, OpenAI `type`, and the request field at fault."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        """`Retry-After` (whole seconds, at least 1) and OpenAI's `retry-after-ms`, which the
        official clients honour before retrying a 429."""
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s))),
                "retry-after-ms": str(max(1, math.ceil(self.retry_after_s * 1000)))}


_BY_CODE: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNIMPLEMENTED: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error"),
    grpc.StatusCode.CANCELLED: (499, "server_error"),
}


def from_sciproto(error: SciprotoError) -> ApiError:
    """The answer for a failed Generate: a prompt longer than the context is OpenAI's
    `context_length_exceeded`; a policy server refusing the gateway's own token is a 502 (the
    caller cannot fix it)."""
    status, type_ = _BY_CODE.get(error.code, (500, "server_error"))
    if error.code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return ApiError(502, f"the policy server refused the gateway's credentials: {error.message}",
                        type_="server_error", code="upstream_auth")
    code = "context_length_exceeded" if error.reason == Reason.PROMPT_TOO_LONG else error.reason.lower()
    param = "messages" if error.reason == Reason.PROMPT_TOO_LONG else None
    retry_after_s = (error.retry_after_s or 1.0) if status == 429 else None
    return ApiError(status, f"policy server: {error.message}", type_=type_, param=param, code=code,
                    retry_after_s=retry_after_s)
