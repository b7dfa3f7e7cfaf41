"""Sandboxed kernels started ahead of the episodes that take them.

    pool = KernelPool(settings, limits, mode)
    pool.start(room=lambda: max_live - live_episodes())   # on the event loop: refilling begins
    kernel = await pool.take()       # a warm one if there is one, else one started now
    ...                              # the episode copies its data into kernel.workspace and runs cells
    await kernel.destroy()           # a kernel serves one episode, then goes with it
    await pool.aclose()              # every kernel still in the pool is killed, its directories removed

Each kernel has a sandbox and an empty workspace of its own and, when `preload` names modules,
has imported them already. `take` never waits for a boot when a warm kernel is there: it checks
that the kernel answers (a dead one is dropped, counted as replaced, and never handed out) and
wakes the refill, which starts kernels in the background, `refill_parallel` at a time, until the
pool holds `size` again. The refill pauses (and `take` starts kernels on demand, as with no pool)
while the server has no room for them: its episodes plus the pool's kernels at its
`max_live_episodes`, or less memory available on the host than `min_available_mb`. A refill that
fails backs off, up to MAX_BACKOFF_S between tries.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from env_servers import scratch
from env_servers.envs.kernel import CellLimits, SandboxedKernel
from env_servers.sandbox import Sandbox, SandboxLimits, SandboxMode

log = logging.getLogger("env_servers.kernel_pool")

ANSWER_TIMEOUT_S = 2.0  # a warm kernel that does not answer kernel_info within this is dropped
CHECK_S = 1.0  # how often an idle refill looks for dead warm kernels and for room to refill
MAX_BACKOFF_S = 30.0
PRELOAD_LIMITS = CellLimits(wall_s=120, cpu_s=120, max_output_chars=10_000)


@dataclass
class PoolSettings:
    size: int  # kernels kept warm; 0: no pool
    refill_parallel: int  # kernels started at once by the refill
    preload: Sequence[str]  # modules each pooled kernel imports ahead
    min_available_mb: int  # the refill starts no kernel while the host has less memory available


@dataclass
class PoolStats:
    size: int
    warm: int  # ready in the pool now
    starting: int  # being started by the refill now
    hits: int  # takes answered by a warm kernel
    misses: int  # takes that started a kernel on demand (the pool was empty or off)
    replaced: int  # warm kernels found dead or silent, dropped and replaced
    preload: list[str]


@dataclass
class PooledKernel:
    """A kernel, its sandbox and its workspace: whoever takes it owns all three."""

    workspace: Path
    sandbox: Sandbox
    kernel: SandboxedKernel

    async def destroy(self) -> None:
        """Kill the kernel's sandbox and remove its runtime directory and workspace."""
        try:
            await self.kernel.stop()
        finally:
            self.sandbox.remove()
            shutil.rmtree(self.workspace, ignore_errors=True)


async def start_kernel(limits: SandboxLimits, mode: SandboxMode, preload: Sequence[str] = ()) -> PooledKernel:
    """A kernel in a new sandbox on a new empty workspace (with `preload` imported)."""
    workspace = scratch.mkdtemp("sciproto-ws-")
    sandbox: Sandbox | None = None
    try:
        sandbox = Sandbox(workspace, limits, mode)
        kernel = await SandboxedKernel.start(sandbox)
    except BaseException:
        if sandbox is not None:
            sandbox.remove()
        shutil.rmtree(workspace, ignore_errors=True)
        raise
    started = PooledKernel(workspace, sandbox, kernel)
    try:
        await kernel.import_modules(preload, PRELOAD_LIMITS)
    except BaseException:
        await started.destroy()
        raise
    return started


def available_memory_mb() -> int | None:
    """MemAvailable of /proc/meminfo in MiB; None where it cannot be read."""
    try:
        with open("/proc/meminfo", "rb") as meminfo:
            for line in meminfo:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) >> 10
    except (OSError, ValueError, IndexError):
        return None
    return None


class KernelPool:
    """Warm kernels for one environment of one server."""

    def __init__(self, settings: PoolSettings, limits: SandboxLimits, mode: SandboxMode) -> None:
        self.settings = settings
        self.limits, self.mode = limits, mode
        self._warm: deque[PooledKernel] = deque()
        self._starting = 0
        self._wake = asyncio.Event()
        self._workers: list[asyncio.Task[None]] = []
        self._room: Callable[[], int] = lambda: settings.size
        self._dropping: set[asyncio.Task[None]] = set()
        self.hits = self.misses = self.replaced = 0
        self._closed = False

    def start(self, room: Callable[[], int] | None = None) -> None:
        """Start refilling (on the running event loop). `room`: how many more kernels the server
        may hold now (its episode limit less its open episodes); the pool's own count against it."""
        if room is not None:
            self._room = room
        if self.settings.size > 0 and not self._workers and not self._closed:
            loop = asyncio.get_running_loop()
            self._workers = [loop.create_task(self._refill_forever(), name=f"kernel-pool-refill-{i}")
                             for i in range(self.settings.refill_parallel)]

    def stats(self) -> PoolStats:
        return PoolStats(self.settings.size, len(self._warm), self._starting, self.hits, self.misses,
                         self.replaced, list(self.settings.preload))

    async def take(self) -> PooledKernel:
        """A warm kernel that answers, or, when the pool has none, one started now (no preload:
        as without a pool). Never an error for an empty pool; a failed on-demand start raises."""
        while self._warm:
            pooled = self._warm.popleft()
            try:
                answered = await pooled.kernel.answers(ANSWER_TIMEOUT_S)
            except BaseException:  # the Reset was cancelled meanwhile: the kernel goes back, untouched
                self._warm.appendleft(pooled)
                raise
            if answered:
                self.hits += 1
                self._wake.set()
                return pooled
            self._drop(pooled)
        if self.settings.size > 0:
            self.misses += 1
            self._wake.set()
        return await start_kernel(self.limits, self.mode)

    def _drop(self, pooled: PooledKernel) -> None:
        """Count a dead or silent warm kernel as replaced and destroy it in the background."""
        self.replaced += 1
        log.warning("a warm kernel (workspace %s) died or stopped answering; it is replaced", pooled.workspace)
        task = asyncio.get_running_loop().create_task(pooled.destroy())
        self._dropping.add(task)
        task.add_done_callback(self._dropping.discard)
        self._wake.set()

    def _wanted(self) -> int:
        """Kernels the refill should start now: the pool's shortfall, within the server's room."""
        held = len(self._warm) + self._starting
        return min(self.settings.size - held, self._room() - held)

    def _pressed(self) -> bool:
        available = available_memory_mb()
        return available is not None and available < self.settings.min_available_mb

    async def _refill_forever(self) -> None:
        failures = 0
        while True:
            for pooled in [p for p in self._warm if not p.kernel.process.alive]:
                self._warm.remove(pooled)
                self._drop(pooled)
            if self._wanted() <= 0 or self._pressed():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), CHECK_S)
                self._wake.clear()
                continue
            self._starting += 1
            try:
                pooled = await start_kernel(self.limits, self.mode, self.settings.preload)
            except Exception as error:  # noqa: BLE001 -- logged; the pool tries again, later each time
                failures += 1
                delay = min(2.0 ** failures, MAX_BACKOFF_S)
                log.warning("the kernel pool could not start a kernel (%s: %s); trying again in %g s",
                            type(error).__name__, error, delay)
                await asyncio.sleep(delay)
                continue
            finally:
                self._starting -= 1
            failures = 0
            if self._closed:
                await pooled.destroy()
                return
            self._warm.append(pooled)

    async def aclose(self) -> None:
        """Stop refilling and destroy every kernel in the pool (those being started included)."""
        self._closed = True
        for worker in self._workers:
            worker.cancel()
        for worker in self._workers:
            with contextlib.suppress(asyncio.CancelledError):
                await worker
        self._workers = []
        warm, self._warm = list(self._warm), deque()
        await asyncio.gather(*(pooled.destroy() for pooled in warm), *self._dropping, return_exceptions=True)
