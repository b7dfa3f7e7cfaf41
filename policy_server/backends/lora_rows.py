"""LoRA adapters applied per batch row, beside unchanged base weights (the transformers backend).

The served model is never wrapped (PEFT would rename its parameters, and full-weight updates
name the base model's). Instead each adapter's A and B are held apart, and while a forward runs
whose rows use adapters, a forward hook on each targeted nn.Linear adds
`scale * (x A^T) B^T` to the output rows of that adapter's samples: rows of the base and of other
adapters get nothing from it, so base rows and rows of several adapters share one batch. A forward
whose rows all sample the base runs with no hook installed.

Public API: `LoraWeights`, `LoraRows`, `Routing`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from policy_server.backends.adapter_limits import check_rank, check_room
from policy_server.types import AdapterState, TensorSpec
from sciproto.lora import ADAPTER_PREFIX, LoraSpec, adapter_tensor_specs, linear_layers


@dataclass(frozen=True)
class LoraWeights:
    """One adapter as served: its spec, version, and (A, B) on the model's device by module name."""

    spec: LoraSpec
    version: int
    modules: Mapping[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def state(self) -> AdapterState:
        return AdapterState(self.spec, self.version)


# One adapter's share of one linear layer in a forward: A, B, scale, and the batch rows it adds to
# (None: every row).
_Part = tuple[torch.Tensor, torch.Tensor, float, torch.Tensor | None]


@dataclass(frozen=True)
class Routing:
    """Which adapter adds to which rows of one forward: per targeted module, its parts."""

    rows: int
    parts: Mapping[str, list[_Part]]


class LoraRows:
    """The adapters a model serves, at most `max_adapters` of rank up to `max_rank`. `install` and
    `applied` run on the thread that runs the model; `states` may be read from any thread."""

    def __init__(self, model: nn.Module, dtype: str, max_adapters: int, max_rank: int) -> None:
        if max_adapters < 0 or max_rank < 1:
            raise ValueError("need max_adapters >= 0 and max_rank >= 1")
        self.max_adapters = max_adapters
        self.max_rank = max_rank
        self._model = model
        self._dtype = dtype
        self._layers = linear_layers(model)
        self._modules = {name: module for name, module in model.named_modules() if name in self._layers}
        self._held: dict[str, LoraWeights] = {}  # replaced whole on each install, so readers never see it change

    @property
    def held(self) -> Mapping[str, LoraWeights]:
        """The adapters held now; a new mapping after each install (so its identity tells a change)."""
        return self._held

    def states(self) -> dict[str, AdapterState]:
        return {name: weights.state for name, weights in self._held.items()}

    def version(self, name: str) -> int:
        return self._held[name].version

    def manifest(self, spec: LoraSpec) -> list[TensorSpec]:
        """The tensors an update of `spec` carries; ValueError says what this model cannot take."""
        check_rank(spec, self.max_rank)
        return adapter_tensor_specs(self._layers, spec, self._dtype)

    def check_room(self, spec: LoraSpec, version: int) -> None:
        """ValueError when an update of `spec` to `version` cannot be taken next to what is held: a
        new adapter past max_adapters, another shape under a held name, or a version not newer."""
        check_room(self.states(), spec, version, self.max_adapters)

    def prepare(self, spec: LoraSpec, version: int, tensors: Mapping[str, torch.Tensor]) -> LoraWeights:
        """The adapter as served: its tensors (already checked against `manifest(spec)`) copied to
        the model's device, so the caller's tensors are never aliased."""
        device = next(self._model.parameters()).device
        modules = {}
        for name in self._layers:
            key = f"{ADAPTER_PREFIX}{name}"
            if f"{key}.lora_A.weight" in tensors:
                modules[name] = (tensors[f"{key}.lora_A.weight"].detach().to(device, copy=True),
                                 tensors[f"{key}.lora_B.weight"].detach().to(device, copy=True))
        return LoraWeights(spec, version, modules)

    def install(self, weights: LoraWeights) -> None:
        """Serve `weights` from the next forward on (adding it, or replacing the one of its name)."""
        self._held = self._held | {weights.spec.name: weights}

    def routing(self, adapters: Sequence[str]) -> Routing | None:
        """The routing of a forward whose row i samples with `adapters[i]` ("": the base), or None
        when every row samples the base. KeyError names an adapter not held."""
        groups: dict[str, list[int]] = {}
        for row, name in enumerate(adapters):
            if name:
                groups.setdefault(name, []).append(row)
        if not groups:
            return None
        parts: dict[str, list[_Part]] = {}
        for name, rows in groups.items():
            weights = self._held[name]
            first = next(iter(weights.modules.values()))[0]
            index = None if len(rows) == len(adapters) else torch.tensor(rows, device=first.device)
            for module, (a, b) in weights.modules.items():
                parts.setdefault(module, []).append((a, b, weights.spec.scale, index))
        return Routing(len(adapters), parts)

    @contextlib.contextmanager
    def applied(self, routing: Routing | None) -> Iterator[None]:
        """Run the model's forwards inside with `routing`'s adapters added to their rows."""
        if routing is None:
            yield
            return
        handles = [self._modules[name].register_forward_hook(_hook(routing.rows, parts))
                   for name, parts in routing.parts.items()]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def _hook(rows: int, parts: list[_Part]) -> Callable[[nn.Module, tuple, torch.Tensor], torch.Tensor]:
    def add_adapters(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        x = args[0]
        if x.shape[0] != rows:
            raise RuntimeError(f"a LoRA-routed forward of {rows} rows reached a linear layer with input of shape "
                               f"{tuple(x.shape)}; the adapters are routed by the batch's first dimension")
        for a, b, scale, index in parts:
            # as PEFT computes it: lora_B(lora_A(x)) * scaling, added to the base layer's output
            # (in place: the output is the fresh result of this layer's forward, run without autograd)
            if index is None:
                output.add_(F.linear(F.linear(x, a), b) * scale)
            else:
                output.index_add_(0, index, F.linear(F.linear(x.index_select(0, index), a), b) * scale)
        return output

    return add_adapters


__all__ = ["LoraRows", "LoraWeights", "Routing"]
