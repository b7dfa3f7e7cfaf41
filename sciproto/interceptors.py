"""Server interceptors: each wraps every call, whatever its streaming shape,
in one async context (`around`), so a cross-cutting concern is written once
instead of four times (unary/stream x unary/stream)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from sciproto.errors import Internal, InvalidArgument, Reason, SciprotoError, trailers_for

log = logging.getLogger("sciproto.server")


class AroundInterceptor(grpc.aio.ServerInterceptor):
    """Base class: subclasses implement `around(method, context)`.

    grpc.aio asks every interceptor for the handler of every call. The wrapped handler of a
    method is made once and reused while the handler beneath stays the same object (the
    servicer's registered handler, or the same wrapped handler of the next interceptor), so a
    call pays for `around` alone, not for building closures around its handler."""

    _wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]]

    def around(self, method: str, context: grpc.aio.ServicerContext) -> contextlib.AbstractAsyncContextManager[None]:
        raise NotImplementedError

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        wrapped = self.__dict__.setdefault("_wrapped", {})
        known = wrapped.get(method)
        if known is not None and known[0] is handler:
            return known[1]
        made = wrap_handler(self.prepare(handler), method, self.around)
        wrapped[method] = (handler, made)  # holds `handler`, so its identity stays its own
        return made

    def prepare(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """Adapt the handler before it is wrapped; the identity unless a subclass says otherwise."""
        return handler


# A refused client-streaming call reads what its client already sent before the
# refusal goes out, within these bounds. grpc.aio clients whose request write
# meets an already-closed stream report INTERNAL ("Failed execute_batch") in
# place of the server's status (grpc/grpc#36066); reading first lets the
# client's in-flight write and half-close finish, so it sees the real refusal.
REFUSAL_READ_MESSAGES = 8
REFUSAL_READ_S = 0.25


async def read_before_refusing(requests: AsyncIterator[Any]) -> None:
    """Read and drop up to REFUSAL_READ_MESSAGES requests, until the client
    half-closes or REFUSAL_READ_S passes, whichever comes first."""

    async def drain() -> None:
        count = 0
        async for _ in requests:
            count += 1
            if count >= REFUSAL_READ_MESSAGES:
                return

    # The call is being refused anyway: a timeout or a bad message ends the reading, nothing more.
    with contextlib.suppress(TimeoutError, SciprotoError, grpc.RpcError):
        await asyncio.wait_for(drain(), REFUSAL_READ_S)


def wrap_handler(
    handler: grpc.RpcMethodHandler,
    method: str,
    around: Callable[[str, grpc.aio.ServicerContext], contextlib.AbstractAsyncContextManager[None]],
) -> grpc.RpcMethodHandler:
    """A copy of `handler` whose behaviour runs inside `around(method, context)`.
    Streaming behaviours must be async generators (all sciproto servicers are).
    When `around` refuses a client-streaming call (raises SciprotoError before
    the behaviour runs), the call reads its client's requests first (see
    `read_before_refusing`)."""
    streams_requests = bool(handler.stream_unary or handler.stream_stream)

    @contextlib.asynccontextmanager
    async def admitted(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        """`around(method, context)`, reading a refused streaming client's requests first."""
        entered = False
        try:
            async with around(method, context):
                entered = True
                yield
        except SciprotoError:
            if not entered and streams_requests:
                await read_before_refusing(request)
            raise

    def unary_response(behaviour: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            async with admitted(request, context):
                return await behaviour(request, context)

        return call

    def stream_response(behaviour: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async with admitted(request, context):
                async for response in behaviour(request, context):
                    yield response

        return call

    if handler.unary_unary:
        return handler._replace(unary_unary=unary_response(handler.unary_unary))
    if handler.stream_unary:
        return handler._replace(stream_unary=unary_response(handler.stream_unary))
    if handler.unary_stream:
        return handler._replace(unary_stream=stream_response(handler.unary_stream))
    return handler._replace(stream_stream=stream_response(handler.stream_stream))


def parse_inside(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A copy of `handler` that takes the request bytes and parses them itself, so that bytes
    that are not the method's message (corrupt wire format, invalid UTF-8 in a string field)
    raise InvalidArgument inside the call: grpc.aio answers a failing deserializer with UNKNOWN."""
    parse = handler.request_deserializer
    if parse is None:
        return handler

    def decode(wire: bytes) -> Any:
        try:
            return parse(wire)
        except Exception as error:  # noqa: BLE001 -- whatever the deserializer raises, the bytes were at fault
            raise InvalidArgument(
                f"the request is not a valid message of this method ({type(error).__name__}: {error});"
                " send the method's request type, with UTF-8 text in every string field",
                Reason.INVALID_REQUEST) from None

    async def decoded(requests: AsyncIterator[bytes]) -> AsyncIterator[Any]:
        async for wire in requests:
            yield decode(wire)

    def one(behaviour: Callable[..., Any]) -> Callable[..., Any]:
        return lambda request, context: behaviour(decode(request), context)

    def many(behaviour: Callable[..., Any]) -> Callable[..., Any]:
        return lambda requests, context: behaviour(decoded(requests), context)

    if handler.unary_unary:
        return handler._replace(request_deserializer=None, unary_unary=one(handler.unary_unary))
    if handler.unary_stream:
        return handler._replace(request_deserializer=None, unary_stream=one(handler.unary_stream))
    if handler.stream_unary:
        return handler._replace(request_deserializer=None, stream_unary=many(handler.stream_unary))
    return handler._replace(request_deserializer=None, stream_stream=many(handler.stream_stream))


class ErrorInterceptor(AroundInterceptor):
    """Turns SciprotoError into its status with ErrorInfo; anything unexpected
    into INTERNAL with the traceback logged here (never sent to the client).
    Requests are parsed inside it (see `parse_inside`), so undecodable bytes
    are INVALID_ARGUMENT."""

    def prepare(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        return parse_inside(handler)

    @contextlib.asynccontextmanager
    async def around(self, method: str, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        try:
            yield
        except grpc.aio.AbortError:
            raise
        except SciprotoError as error:
            await context.abort(*trailers_for(error))
        except Exception as error:  # a bug: keep serving, tell the client what kind
            log.exception("unexpected error in %s", method)
            internal = Internal(
                f"internal error in {method}: {type(error).__name__}: {error}; "
                "the server logged the traceback"
            )
            await context.abort(*trailers_for(internal))


class LoggingInterceptor(AroundInterceptor):
    """One log line per call: method, outcome, duration, at debug level; while that level is
    off, calls pass straight through."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if not log.isEnabledFor(logging.DEBUG):
            return await continuation(handler_call_details)
        return await super().intercept_service(continuation, handler_call_details)

    @contextlib.asynccontextmanager
    async def around(self, method: str, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        start = time.perf_counter()
        outcome = "OK"
        try:
            yield
        except BaseException as error:
            outcome = type(error).__name__
            raise
        finally:
            code = context.code() if hasattr(context, "code") else None
            if code not in (None, grpc.StatusCode.OK, 0):
                outcome = str(code)
            log.debug("%s %s %.1f ms", method, outcome, (time.perf_counter() - start) * 1e3)
