"""What every check needs from the wire: expected failures decoded from their rich status, and
a runner that times each check and turns whatever it raises into a FAIL with the reason."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from sciproto.conformance.report import CheckResult, Outcome, Report

DOMAIN = "sciproto"
STATUS_DETAILS_KEY = "grpc-status-details-bin"


class CheckFailed(AssertionError):
    """The server did something the contract does not allow; the message says what."""


class Skipped(Exception):  # a check's outcome, not an error
    """The server does not offer what this check needs."""


@dataclass
class WireError:
    """A failed call as the contract describes it: code, ErrorInfo and RetryInfo."""

    code: grpc.StatusCode
    message: str
    reason: str | None = None
    domain: str | None = None
    retry_delay_s: float | None = None

    def __str__(self) -> str:
        return f"{self.code.name}/{self.reason or 'no ErrorInfo'}: {self.message}"


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def decode_status(status: status_pb2.Status) -> WireError:
    """A google.rpc.Status (from trailers or in-band) with its ErrorInfo and RetryInfo."""
    error = WireError(_CODES.get(status.code, grpc.StatusCode.UNKNOWN), status.message)
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            error.reason, error.domain = info.reason, info.domain
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            error.retry_delay_s = retry.retry_delay.seconds + retry.retry_delay.nanos / 1e9
    return error


def decode_rpc_error(error: grpc.aio.AioRpcError) -> WireError:
    for key, value in error.trailing_metadata() or ():
        if key == STATUS_DETAILS_KEY:
            status = status_pb2.Status.FromString(value)
            decoded = decode_status(status)
            if decoded.code != error.code():
                raise CheckFailed(f"the status trailer says {decoded.code.name} but the call ended with "
                                  f"{error.code().name}")
            return decoded
    return WireError(error.code(), error.details() or "")


def expect_error(error: WireError, code: grpc.StatusCode, reason: str | None, *,
                 retry_info: bool = False) -> WireError:
    """Check that `error` is `code` with ErrorInfo(domain sciproto, `reason`)."""
    if error.code != code:
        raise CheckFailed(f"expected {code.name}/{reason}, got {error}")
    if reason is not None:
        if error.reason is None:
            raise CheckFailed(f"{code.name} came without a google.rpc.ErrorInfo in {STATUS_DETAILS_KEY}"
                              f" (expected reason {reason})")
        if error.domain != DOMAIN:
            raise CheckFailed(f"ErrorInfo.domain is {error.domain!r}, expected {DOMAIN!r}")
        if error.reason != reason:
            raise CheckFailed(f"expected reason {reason}, got {error}")
    if retry_info and error.retry_delay_s is None:
        raise CheckFailed(f"{error} came without a google.rpc.RetryInfo")
    return error


async def call_fails(call: Awaitable[object], code: grpc.StatusCode, reason: str | None, *,
                     retry_info: bool = False) -> WireError:
    """Await a unary call that must fail with `code`/`reason`."""
    try:
        response = await call
    except grpc.aio.AioRpcError as error:
        return expect_error(decode_rpc_error(error), code, reason, retry_info=retry_info)
    raise CheckFailed(f"expected {code.name}/{reason}, but the call succeeded: {_short(response)}")


async def call_ok(call: Awaitable[object], what: str) -> object:
    """Await a call that must succeed; its failure is a CheckFailed naming `what`."""
    try:
        return await call
    except grpc.aio.AioRpcError as error:
        raise CheckFailed(f"{what} failed: {decode_rpc_error(error)}") from None


def check(condition: object, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def _short(message: object) -> str:
    text = str(message).replace("\n", " ")
    return text if len(text) < 160 else text[:157] + "..."


async def health_status(channel: grpc.aio.Channel, service: str, timeout_s: float) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    response = await call_ok(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s),
                             f"Health.Check({service!r})")
    return response.status  # type: ignore[attr-defined, no-any-return]


async def check_health(channel: grpc.aio.Channel, service: str, timeout_s: float) -> str:
    serving = health_pb2.HealthCheckResponse.SERVING
    for name in ("", service):
        status = await health_status(channel, name, timeout_s)
        check(status == serving, f"Health.Check({name!r}) is "
                                 f"{health_pb2.HealthCheckResponse.ServingStatus.Name(status)}, not SERVING")
    return f"'' and {service} SERVING"


async def check_reflection(channel: grpc.aio.Channel, service: str, timeout_s: float) -> str:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    names: list[str] = []
    call = stub.ServerReflectionInfo(iter([request]), timeout=timeout_s)
    try:
        async for response in call:
            names = [entry.name for entry in response.list_services_response.service]
    except grpc.aio.AioRpcError as error:
        raise CheckFailed(f"ServerReflectionInfo failed: {decode_rpc_error(error)}") from None
    missing = {service, "grpc.health.v1.Health"} - set(names)
    check(not missing, f"reflection does not list {sorted(missing)} (lists {names})")
    return f"lists {len(names)} services"


Check = Callable[[], Awaitable[str | None]]


async def run_checks(report: Report, checks: list[tuple[str, Check]], timeout_s: float) -> Report:
    """Run each check in turn, bounded by `timeout_s`; record PASS, FAIL or SKIP with the reason."""
    for name, run in checks:
        started = time.monotonic()
        try:
            detail = await asyncio.wait_for(run(), timeout_s)
            result = CheckResult(name, Outcome.PASS, detail or "")
        except Skipped as skipped:
            result = CheckResult(name, Outcome.SKIP, str(skipped))
        except CheckFailed as failed:
            result = CheckResult(name, Outcome.FAIL, str(failed))
        except TimeoutError:
            result = CheckResult(name, Outcome.FAIL, f"no result within {timeout_s:g} s")
        except grpc.aio.AioRpcError as error:
            result = CheckResult(name, Outcome.FAIL, f"unexpected {decode_rpc_error(error)}")
        except Exception as error:  # noqa: BLE001 -- a server answering garbage fails the check, not the kit
            result = CheckResult(name, Outcome.FAIL, f"{type(error).__name__}: {error}")
        result.seconds = round(time.monotonic() - started, 3)
        report.results.append(result)
    return report
