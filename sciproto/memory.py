"""Giving memory back to the operating system once a burst of work is over.

CPython and the C allocator keep memory they have freed for reuse: after a thousand episodes have
come and gone, a server's resident size stays near its peak although nothing holds the objects.
`release_freed_memory` collects garbage and asks glibc to trim its heaps (`malloc_trim`), so a
server that is idle again is about as small as it started. Elsewhere than glibc only the
collection runs. `trim_heap` is the trim alone, for a hot loop that needs no collection (the
learner after each step).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from functools import cache

__all__ = ["release_freed_memory", "trim_heap"]


@cache
def _malloc_trim() -> ctypes._CFuncPtr | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        return None


def trim_heap() -> None:
    """glibc's malloc_trim(0): the heaps' free pages go back to the OS (a no-op elsewhere)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def release_freed_memory() -> None:
    """A full garbage collection, then `trim_heap`: freed memory goes back to the OS."""
    gc.collect()
    trim_heap()
