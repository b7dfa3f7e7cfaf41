"""The error model: one exception type that maps to a gRPC status with
`google.rpc.ErrorInfo` (stable `reason`, domain "sciproto") and, when the
caller should come back later, `google.rpc.RetryInfo`.

Servers raise `SciprotoError` (or a subclass); the error interceptor turns it
into a rich status. Clients turn an `AioRpcError` back into the same typed
exception with `from_rpc_error`, so code on both sides matches on `reason`,
never on message text.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

import grpc
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

DOMAIN = "sciproto"


class Reason(enum.StrEnum):
    """Stable machine-readable causes, carried in ErrorInfo.reason."""

    INVALID_REQUEST = "INVALID_REQUEST"  # a field is missing or malformed
    UNKNOWN_ENVIRONMENT = "UNKNOWN_ENVIRONMENT"
    UNKNOWN_SPLIT = "UNKNOWN_SPLIT"
    TASK_OUT_OF_RANGE = "TASK_OUT_OF_RANGE"
    EPISODE_NOT_FOUND = "EPISODE_NOT_FOUND"  # never opened, closed or expired
    EPISODE_FINISHED = "EPISODE_FINISHED"  # stepping a terminated/truncated episode
    INVALID_ACTION = "INVALID_ACTION"  # the assistant message cannot be applied
    TOO_MANY_EPISODES = "TOO_MANY_EPISODES"
    RATE_LIMITED = "RATE_LIMITED"
    STEP_TIMEOUT = "STEP_TIMEOUT"
    ENVIRONMENT_FAILED = "ENVIRONMENT_FAILED"
    INVALID_WEIGHTS = "INVALID_WEIGHTS"  # manifest does not match the model
    WEIGHTS_INCOMPLETE = "WEIGHTS_INCOMPLETE"  # stream ended before total_bytes
    STALE_VERSION = "STALE_VERSION"  # update would not move the version forward
    UPDATE_IN_PROGRESS = "UPDATE_IN_PROGRESS"  # another weight update is being received or applied
    WEIGHTS_UNAVAILABLE = "WEIGHTS_UNAVAILABLE"  # an update failed part way; serving resumes after a complete one
    UNSUPPORTED = "UNSUPPORTED"  # the backend lacks this capability
    UNKNOWN_ADAPTER = "UNKNOWN_ADAPTER"  # a Generate names a LoRA adapter the policy server does not hold
    TOO_MANY_ADAPTERS = "TOO_MANY_ADAPTERS"  # a new adapter past the policy server's max_adapters
    PROMPT_TOO_LONG = "PROMPT_TOO_LONG"
    DUPLICATE_REQUEST = "DUPLICATE_REQUEST"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    CANCELLED = "CANCELLED"  # a Session operation stopped by the client's cancel
    TOO_MANY_IN_FLIGHT = "TOO_MANY_IN_FLIGHT"  # a Session stream is at its max_in_flight
    NO_HEALTHY_REPLICA = "NO_HEALTHY_REPLICA"  # client side: no server of a service answers
    INCOMPATIBLE_PROTOCOL = "INCOMPATIBLE_PROTOCOL"  # client side: the server speaks another major version
    INTERNAL = "INTERNAL"


class SciprotoError(Exception):
    """An error with a gRPC code, a stable reason and an actionable message."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(
        self,
        message: str,
        reason: Reason | str = Reason.INTERNAL,
        *,
        code: grpc.StatusCode | None = None,
        metadata: Mapping[str, str] | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.reason = str(reason)
        if code is not None:
            self.code = code
        self.metadata = dict(metadata or {})
        self.retry_after_s = retry_after_s

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code.name}, {self.reason}: {self.message})"


class InvalidArgument(SciprotoError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(SciprotoError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(SciprotoError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(SciprotoError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Cancelled(SciprotoError):
    code = grpc.StatusCode.CANCELLED


class DeadlineExceeded(SciprotoError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(SciprotoError):
    code = grpc.StatusCode.UNAVAILABLE


class Unimplemented(SciprotoError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Unauthenticated(SciprotoError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(SciprotoError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Internal(SciprotoError):
    code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[SciprotoError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument, NotFound, FailedPrecondition, ResourceExhausted, Cancelled, DeadlineExceeded,
        Unavailable, Unimplemented, Unauthenticated, PermissionDenied, Internal,
    )
}
_GRPC_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def first_line(error: BaseException) -> str:
    """The first line of `error`'s message, or its type's name when it has none: for a log line or
    an error message that quotes another error."""
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def to_status(error: SciprotoError) -> status_pb2.Status:
    """The google.rpc.Status for an error: code, message, ErrorInfo, RetryInfo."""
    info = error_details_pb2.ErrorInfo(reason=error.reason, domain=DOMAIN, metadata=error.metadata)
    status = status_pb2.Status(code=error.code.value[0], message=error.message)
    status.details.add().Pack(info)
    if error.retry_after_s is not None:
        seconds = int(error.retry_after_s)
        delay = duration_pb2.Duration(seconds=seconds, nanos=int((error.retry_after_s - seconds) * 1e9))
        status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    return status


def from_status(status: status_pb2.Status) -> SciprotoError:
    """The typed exception for a google.rpc.Status (in-band or from trailers)."""
    code = _GRPC_BY_NUMBER.get(status.code, grpc.StatusCode.UNKNOWN)
    reason, metadata, retry_after = Reason.INTERNAL.value, {}, None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason, metadata = info.reason, dict(info.metadata)
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            retry_after = retry.retry_delay.seconds + retry.retry_delay.nanos / 1e9
    cls = _BY_CODE.get(code, SciprotoError)
    return cls(status.message, reason, code=code, metadata=metadata, retry_after_s=retry_after)


STATUS_DETAILS_KEY = "grpc-status-details-bin"


def trailers_for(error: SciprotoError) -> tuple[grpc.StatusCode, str, tuple[tuple[str, bytes], ...]]:
    """(code, details, trailing metadata) to abort a call with this error."""
    status = rpc_status.to_status(to_status(error))
    return status.code, status.details, tuple(status.trailing_metadata)


def from_rpc_error(error: grpc.RpcError) -> SciprotoError:
    """The typed exception for a failed call, reading the rich status trailers
    when the server sent them and falling back to the plain code otherwise."""
    trailers = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in trailers or ():
        if key == STATUS_DETAILS_KEY:
            return from_status(status_pb2.Status.FromString(value))
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    reason = Reason.UNAUTHENTICATED if code == grpc.StatusCode.UNAUTHENTICATED else code.name
    cls = _BY_CODE.get(code, SciprotoError)
    return cls(details or code.name, reason, code=code)
