"""`auto` dtype and precision: bf16 where the device multiplies bf16 natively, fp32 elsewhere
(sciproto.hardware); the rule on given CPU flags, and this machine's own flags read."""

from __future__ import annotations

from pathlib import Path

import pytest

from sciproto.hardware import auto_dtype, auto_precision, cpu_flags


@pytest.mark.parametrize(("flags", "dtype", "precision"), [
    ({"avx2", "avx512f", "amx_tile", "amx_bf16"}, "bfloat16", "bf16"),
    # AVX-512 bf16 dot products without AMX (AMD Zen 4, Intel Cooper Lake): measured faster too.
    ({"avx2", "avx512f", "avx512_bf16"}, "bfloat16", "bf16"),
    ({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}, "bfloat16", "bf16"),  # both: AMX is named
    ({"avx2", "avx512f"}, "float32", "fp32"),
    (set(), "float32", "fp32"),
])
def test_auto_picks_bf16_only_on_a_cpu_with_bf16_matmul_instructions(
        flags: set[str], dtype: str, precision: str) -> None:
    assert auto_dtype("cpu", frozenset(flags))[0] == dtype
    assert auto_precision("cpu", frozenset(flags))[0] == precision
    reason = auto_dtype("cpu", frozenset(flags))[1]
    named = "amx_bf16" if "amx_bf16" in flags else "avx512_bf16"
    assert (named in reason) == (dtype == "bfloat16"), reason


def test_this_machines_flags_are_read_from_its_cpuinfo() -> None:
    text = Path("/proc/cpuinfo").read_text()
    line = next(line for line in text.splitlines() if line.split(":")[0].strip() in ("flags", "Features"))
    assert cpu_flags() == frozenset(line.split(":", 1)[1].split())
    bf16_flags = {"amx_bf16", "avx512_bf16"} & cpu_flags()
    assert auto_dtype("cpu")[0] == ("bfloat16" if bf16_flags else "float32")


def test_a_cuda_device_is_bf16_only_where_torch_says_it_computes_bf16() -> None:
    import torch

    native = torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    assert auto_dtype("cuda:0")[0] == ("bfloat16" if native else "float32")
