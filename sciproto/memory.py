"""Giving memory back to the operating system once a burst of work is over.

CPython and the C allocator keep memory they have freed for reuse: after a thousand episodes have
come and gone, a server's resident size stays near its peak although nothing holds the objects.
`release_freed_memory` collects garbage and asks glibc to trim its heaps (`malloc_trim`), so a
server that is idle again is about as small as it started. Elsewhere than glibc only the
collection runs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from functools import cache

__all__ = ["release_freed_memory"]


@cache
def _malloc_trim() -> ctypes._CFuncPtr | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        return None


def release_freed_memory() -> None:
    """A full garbage collection, then glibc's malloc_trim(0): freed memory goes back to the OS."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
