"""Silence the start-up warnings that are expected, so that a warning in a server's log means
something.

Importing torchao (FP8 training) on a machine without CUDA logs that its compiled extensions fail
to load (its wheel ships builds for one Python and CUDA's kernels) and that Triton is missing,
and torch then warns, once per enum, that torchao registers Enum subclasses as pytree constants,
a deprecation in torch's own API. None of it changes what sciproto does: float8 training
on a CPU runs the emulated path (`precision: fp8-emulated`), and on a GPU a missing kernel fails
with an error of its own. These records are dropped and replaced by one DEBUG line
(`sciproto serve ... --verbose` shows it); on a machine with CUDA, torchao's own warnings stay.
"""

from __future__ import annotations

import logging
import re
import threading

log = logging.getLogger("sciproto.quiet")

# (logger name, message pattern, expected only without CUDA)
EXPECTED: tuple[tuple[str, re.Pattern[str], bool], ...] = (
    ("torchao", re.compile(r"Failed to load .*torchao/_C\w*.*\.so"), True),
    ("torchao.kernel.intmm", re.compile(r"Detected no triton"), True),
    ("torch.utils._pytree", re.compile(r"is an Enum subclass and is now natively supported"), False),
)


class _ExpectedNoise(logging.Filter):
    """Drops the expected records of one logger; the first one dropped anywhere is noted once."""

    reported = False
    lock = threading.Lock()

    def __init__(self, pattern: re.Pattern[str], only_without_cuda: bool) -> None:
        super().__init__()
        self.pattern = pattern
        self.only_without_cuda = only_without_cuda

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.pattern.search(record.getMessage()):
            return True
        if self.only_without_cuda and _cuda_available():
            return True
        with _ExpectedNoise.lock:
            first, _ExpectedNoise.reported = not _ExpectedNoise.reported, True
        if first:
            log.debug("torchao/torch start-up warnings expected on this machine were silenced"
                      " (no CUDA build of torchao's extensions, no Triton, pytree deprecations)")
        return False


def _cuda_available() -> bool:
    import sys

    torch = sys.modules.get("torch")  # the records come from importing torch or torchao
    return bool(torch is not None and torch.cuda.is_available())


_installed = False


def expected_startup_noise() -> None:
    """Install the filters (idempotent); call before torch or torchao is imported."""
    global _installed
    if _installed:
        return
    _installed = True
    for name, pattern, only_without_cuda in EXPECTED:
        logging.getLogger(name).addFilter(_ExpectedNoise(pattern, only_without_cuda))


__all__ = ["EXPECTED", "expected_startup_noise"]
