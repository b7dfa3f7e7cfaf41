"""The session store's idle sweep, on a clock the test moves: sessions idle past the TTL are
dropped and counted whatever order they were opened and used in; a session in a call stays, and its idle time counts from the call's end."""

from __future__ import annotations

import asyncio
import types

import pytest

from gateway import sessions
from gateway.sessions import SessionLimits, SessionStore


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(sessions, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    return clock


def test_the_sweep_drops_idle_sessions_in_any_order_of_use(clock: Clock) -> None:
    store = SessionStore(SessionLimits(idle_ttl_s=10))
    for name in ("a", "b", "c"):
        store.open(name, "")
    clock.now += 6
    store.open("a", "")  # used again: now the freshest, though opened first
    clock.now += 6  # b and c idle 12 s, a 6 s
    store.sweep()
    assert list(store.sessions) == ["a"] and store.expired == 2
    clock.now += 6
    store.open("d", "")  # a is past its TTL now, d is new
    assert list(store.sessions) == ["d"] and store.expired == 3


def test_a_session_in_a_call_is_not_swept_and_does_not_shield_idle_ones(clock: Clock) -> None:
    async def run() -> None:
        store = SessionStore(SessionLimits(idle_ttl_s=10))
        busy, idle = store.open("busy", ""), store.open("idle", "")
        async with busy.lock:  # a call longer than the TTL
            clock.now += 20
            store.sweep()
            assert list(store.sessions) == ["busy"] and store.expired == 1
        store.touch(busy)  # the call's end, as the gateway marks it: the TTL counts from here
        assert idle.id not in store.sessions
        store.sweep()
        assert list(store.sessions) == ["busy"]
        clock.now += 11  # idle past the TTL since the call ended
        store.sweep()
        assert not store.sessions and store.expired == 2

    asyncio.run(run())
