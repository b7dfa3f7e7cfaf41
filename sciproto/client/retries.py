"""Per-call deadlines and bounded retries with exponential backoff for the rollout client.

Only failures that a later try can cure are retried: UNAVAILABLE (server not reached),
DEADLINE_EXCEEDED (too slow this time) and RESOURCE_EXHAUSTED (come back after RetryInfo's
delay). Every sciproto request carries a `request_id` that stays the same across tries, so a
retried Step is answered from the server's idempotency cache instead of stepping twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
from pydantic import BaseModel, Field

from sciproto.errors import (
    DeadlineExceeded,
    ResourceExhausted,
    SciprotoError,
    Unavailable,
    from_rpc_error,
)

T = TypeVar("T")

RETRYABLE = (Unavailable, DeadlineExceeded, ResourceExhausted)


class RetryPolicy(BaseModel):
    """How often and how patiently a failed call is tried again."""

    attempts: int = Field(3, ge=1, le=10, description="Tries per call (the first one included)")
    initial_backoff_s: float = Field(0.2, gt=0, description="Wait before the second try")
    max_backoff_s: float = Field(2.0, gt=0, description="Longest wait between tries")
    episode_restarts: int = Field(2, ge=0, le=10, description=(
        "Times an episode whose environment replica died (or stayed too slow) is started again"
        " from Reset on another replica before it is recorded INFRA_ERROR"))

    def backoff_s(self, attempt: int, error: SciprotoError) -> float:
        """Wait after failed try `attempt` (0-based): initial * 2^attempt, capped; the server's
        RetryInfo delay when it gave one."""
        if error.retry_after_s is not None:
            return min(error.retry_after_s, self.max_backoff_s * 4)
        return min(self.initial_backoff_s * 2**attempt, self.max_backoff_s)


class Deadlines(BaseModel):
    """Most seconds each call may take, per try."""

    reset_s: float = Field(60.0, gt=0, description="Reset")
    step_s: float = Field(180.0, gt=0, description="Above the env server's own step timeout, so it reports first")
    generate_s: float = Field(300.0, gt=0, description="Whole Generate stream, all samples")
    verify_s: float = Field(60.0, gt=0, description="Verify")
    close_s: float = Field(10.0, gt=0, description="Close")
    describe_s: float = Field(10.0, gt=0, description="Describe")


# Slack on top of the gRPC deadline, so the server's DEADLINE_EXCEEDED normally arrives first.
_LOCAL_SLACK_S = 1.0


async def call_with_deadline(operation: Callable[[float], Awaitable[T]], deadline_s: float, what: str) -> T:
    """One try of `operation(timeout_s)` (which passes the timeout on as the gRPC deadline),
    also cancelled locally if it outlives it; failures come out as SciprotoError."""
    try:
        async with asyncio.timeout(deadline_s + _LOCAL_SLACK_S):
            return await operation(deadline_s)
    except TimeoutError:
        raise DeadlineExceeded(f"{what} took longer than {deadline_s:g} s; raise deadlines.* if the"
                               " server is merely slow") from None
    except grpc.RpcError as error:
        raise from_rpc_error(error) from error


async def with_retries(operation: Callable[[float], Awaitable[T]], policy: RetryPolicy, deadline_s: float,
                       what: str) -> T:
    """`operation(timeout_s)` tried up to `policy.attempts` times, each try bounded by `deadline_s`.
    Raises the last error when every try failed or at once for an error no retry can cure."""
    for attempt in range(policy.attempts):
        try:
            return await call_with_deadline(operation, deadline_s, what)
        except RETRYABLE as error:
            if attempt + 1 == policy.attempts:
                raise
            await asyncio.sleep(policy.backoff_s(attempt, error))
    raise AssertionError("unreachable: the loop returns or raises")
