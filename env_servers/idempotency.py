"""Answers for retried requests: an operation that carries a request_id runs once; a retry with
the same id (while the first is still running, or after) gets the first result.

Unary operations run as their own tasks, so a caller that gives up (deadline, disconnect) does
not cut an environment step in half: the step finishes and its result waits here for the retry.
Only successes are kept: a failed operation can be tried again with the same id. A result
unused for `ttl_s` (the episode idle TTL: by then its episode has expired too) is dropped, so
the cache empties once traffic stops instead of holding its last `size` answers for ever.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Any, TypeVar

from sciproto.errors import InvalidArgument, Reason, Unavailable

T = TypeVar("T")


@dataclass
class _Entry:
    fingerprint: Hashable  # what the request asked for; a reused id must ask the same
    task: asyncio.Future[Any]
    last_used: float  # time.monotonic() of the first call or the latest retry


class IdempotencyCache:
    """A bounded LRU map from (operation, request_id) to the operation's task, whose entries
    expire `ttl_s` after their last use."""

    def __init__(self, size: int, ttl_s: float) -> None:
        self.size = size
        self.ttl_s = ttl_s
        self._entries: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self._expiry: asyncio.TimerHandle | None = None

    async def run(self, operation: str, request_id: str, fingerprint: Hashable,
                  run: Callable[[], Awaitable[T]], *, detach: bool = True) -> T:
        """`await run()` once per request_id; without a request_id, every call runs.

        detach: run the operation as its own task, so that it finishes even if this caller is
        cancelled (unary calls). Without it (Session streams, whose end closes their episodes
        anyway) the operation runs in the caller's task and is cancelled with it.
        """
        if not request_id:
            return await run()
        key = (operation, request_id)
        entry = self._entries.get(key)
        if entry is not None:
            if entry.fingerprint != fingerprint:
                raise InvalidArgument(
                    f"request_id {request_id!r} was already used for a different {operation};"
                    " give every new request a new id (a uuid) and reuse an id only to retry",
                    Reason.DUPLICATE_REQUEST)
            self._entries.move_to_end(key)
            entry.last_used = time.monotonic()
            return await asyncio.shield(entry.task)
        if detach:
            task: asyncio.Future[Any] = asyncio.ensure_future(run())
            self._remember(key, _Entry(fingerprint, task, time.monotonic()))
            return await asyncio.shield(task)
        result: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._remember(key, _Entry(fingerprint, result, time.monotonic()))
        try:
            value = await run()
        except asyncio.CancelledError:
            result.set_exception(Unavailable(
                f"the first {operation} with request_id {request_id!r} was cancelled; retry it",
                Reason.SHUTTING_DOWN))
            raise
        except BaseException as error:
            result.set_exception(error)
            raise
        result.set_result(value)
        return value

    def _remember(self, key: tuple[str, str], entry: _Entry) -> None:
        self._entries[key] = entry
        entry.task.add_done_callback(lambda task: self._forget_failure(key, task))
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)  # a running operation goes on; only its retry is lost
        if self._expiry is None:
            self._expiry = asyncio.get_running_loop().call_later(self.ttl_s, self._expire)

    def _expire(self) -> None:
        """Drop entries unused for ttl_s (the oldest-used come first), then check again when
        the next one falls due."""
        self._expiry = None
        cutoff = time.monotonic() - self.ttl_s
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.last_used > cutoff:
                delay = oldest.last_used - cutoff
                self._expiry = asyncio.get_running_loop().call_later(delay, self._expire)
                return
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)

    def _forget_failure(self, key: tuple[str, str], task: asyncio.Future[Any]) -> None:
        if task.cancelled() or task.exception() is not None:
            entry = self._entries.get(key)
            if entry is not None and entry.task is task:
                del self._entries[key]
