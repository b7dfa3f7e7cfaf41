"""What a backend holding LoRA adapters checks before it takes an update of one, whichever engine
holds them: the rank it takes, and room next to the adapters it holds. ValueError says what to fix
(the service maps it to INVALID_ARGUMENT); nothing is changed by a check.

Public API: `check_rank`, `check_room`.
"""

from __future__ import annotations

from collections.abc import Mapping

from policy_server.types import AdapterState
from sciproto.lora import LoraSpec


def check_rank(spec: LoraSpec, max_rank: int) -> None:
    """ValueError when `spec` is of a higher rank than the backend takes."""
    if spec.rank > max_rank:
        raise ValueError(f"adapter {spec.name!r} has rank {spec.rank}; this server takes ranks up to "
                         f"{max_rank} (adapters.max_rank)")


def check_room(held: Mapping[str, AdapterState], spec: LoraSpec, version: int, max_adapters: int) -> None:
    """ValueError when an update of `spec` to `version` cannot be taken next to `held`: a new adapter
    past `max_adapters` or at a negative version, another shape under a held name, or a version not
    newer than the held one."""
    state = held.get(spec.name)
    if state is None:
        if len(held) >= max_adapters:
            raise ValueError(f"this backend holds {len(held)} adapters, its limit (adapters.max_adapters); "
                             f"adapter {spec.name!r} would be one more")
        if version < 0:
            raise ValueError(f"adapter version {version} is negative")
        return
    if state.spec != spec:
        raise ValueError(f"adapter {spec.name!r} is held as {state.spec!r}; an update keeps its shape")
    if version <= state.version:
        raise ValueError(f"version {version} of adapter {spec.name!r} is not newer than its serving version "
                         f"{state.version}")


__all__ = ["check_rank", "check_room"]
