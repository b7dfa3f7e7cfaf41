"""The policy backends a server can be configured with: each a plug-in with a name, what it can
do, and a factory that builds it (its typed options are its section of `PolicyServerConfig`).

Importing this module imports neither torch nor vLLM: a backend's module is imported only when its
factory runs, so a server imports only the backend it serves. The configuration's `backend` names
one of the three registered here.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sciproto.config import ConfigError

if TYPE_CHECKING:
    from policy_server.backends.base import PolicyBackend
    from policy_server.config import PolicyServerConfig


Factory = Callable[["PolicyServerConfig"], "PolicyBackend"]


class Capability(enum.Enum):
    """What a backend declares it can do, beyond sampling; the service checks these."""

    WEIGHT_UPDATES = "weight_updates"  # takes UpdateWeights (update_weights)
    COLLECTIVE_WEIGHTS = "collective_weights"  # takes collective-transport headers (receive_weights_collective)
    LORA_ADAPTERS = "lora_adapters"  # serves named LoRA adapters (base.AdapterBackend; protocol 1.4)


@dataclass(frozen=True)
class BackendPlugin:
    """One policy backend. `load` imports its module (an ImportError when what it needs is not
    installed) and returns its factory, which builds the backend from a PolicyServerConfig; the
    backend also offers `prompt_token_ids(request) -> list[int]` and `tokenizer` (None when prompts
    are rendered elsewhere)."""

    name: str
    load: Callable[[], Factory]
    capabilities: frozenset[Capability]


_BACKENDS: dict[str, BackendPlugin] = {}


def register_backend(plugin: BackendPlugin) -> BackendPlugin:
    if plugin.name in _BACKENDS:
        raise ValueError(f"a policy backend named {plugin.name!r} is registered already")
    _BACKENDS[plugin.name] = plugin
    return plugin


def backend_plugin(name: str) -> BackendPlugin:
    """The plug-in of `name`, or a ConfigError naming the ones there are."""
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ConfigError(f"unknown backend {name!r}: use {', '.join(_BACKENDS)}") from None


# The built-in backends, each module imported by its loader only.


def _load_transformers() -> Factory:
    from policy_server.backends import transformers_backend

    return transformers_backend.build_backend


def _load_vllm() -> Factory:
    from policy_server.backends import vllm_backend

    return vllm_backend.build_backend


def _load_openai() -> Factory:
    from policy_server.backends import openai_backend

    return openai_backend.build_backend


_WEIGHTS = frozenset({Capability.WEIGHT_UPDATES, Capability.COLLECTIVE_WEIGHTS, Capability.LORA_ADAPTERS})

register_backend(BackendPlugin("transformers", _load_transformers, _WEIGHTS))
register_backend(BackendPlugin("vllm", _load_vllm, _WEIGHTS))
register_backend(BackendPlugin("openai", _load_openai, frozenset()))

__all__ = ["BackendPlugin", "Capability", "backend_plugin", "register_backend"]
