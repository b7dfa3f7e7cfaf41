"""The memory of a training step: its peak, measured, and the freed memory given back after it.

A step's activations come and go in pieces of a few to tens of MB. On glibc those below the
mmap threshold (32 MB at most) are carved from the heap, and freeing them does not shrink it:
without a trim the process's resident memory after a step keeps most of the step's peak and
creeps up from step to step (SmolLM2 on a CPU: 8.3, 10.7, 11.2 GB after three steps whose model
and optimizer state need 2.7). `StepMemory.finish` asks glibc to return free heap pages
(`sciproto.memory.trim_heap`) and reports:

    peak_rss_gb   the process's peak resident memory during the step (Linux: VmHWM, restarted
                  at the step's start through /proc/self/clear_refs); None elsewhere
    peak_gpu_gb   torch's peak CUDA allocation during the step; None without CUDA
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from sciproto.memory import trim_heap

__all__ = ["StepMemory", "resident_gb"]

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_gb(field: str) -> float | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1e6  # kB
    except OSError:
        pass
    return None


def resident_gb() -> float | None:
    """The process's resident memory now (Linux), in GB."""
    return _status_gb("VmRSS")


def _restart_peak() -> bool:
    try:
        _CLEAR_REFS.write_text("5")  # "5": reset the peak resident set size (VmHWM)
    except OSError:
        return False
    return True


@dataclass
class StepMemory:
    """`start()` before a step, `finish()` after it."""

    rss_peak_restarted: bool
    cuda: bool

    @classmethod
    def start(cls) -> StepMemory:
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        return cls(_restart_peak(), cuda)

    def finish(self) -> dict[str, float | None]:
        """The step's peaks (see the module's docstring); then freed memory goes back to the OS."""
        peak_rss = _status_gb("VmHWM") if self.rss_peak_restarted else None
        peak_gpu = torch.cuda.max_memory_allocated() / 1e9 if self.cuda else None
        trim_heap()
        return {"peak_rss_gb": peak_rss, "peak_gpu_gb": peak_gpu}
