"""Configuration: pydantic models loaded from YAML, with `key.path=value`
overrides from the command line (values parsed as YAML scalars, so
`learner.grpo.lr=3e-4` is a float and `env.envs=[gsm8k,toy]` a list).

Precedence: an override (`key=value`) beats the file, and the file beats a
default override (`key?=value`, set only where neither gives the key): the CLI
passes its default ports that way, so `server.port` in a file is honoured and
`--port` beats both.

The shipped configs (`configs/*.yaml` in the source tree) install as the
package data `sciproto/configs/` (see setup.py), so `--config demo` works
from an installed wheel too."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

Model = TypeVar("Model", bound=BaseModel)

# An installed wheel holds the shipped configs in sciproto/configs/; the source tree in configs/.
CONFIG_DIRS = (Path(__file__).resolve().parent / "configs", Path(__file__).resolve().parents[1] / "configs")
CONFIG_DIR = next((d for d in CONFIG_DIRS if d.is_dir()), CONFIG_DIRS[-1])


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message says where."""


def apply_override(data: dict[str, Any], override: str) -> None:
    """Set `a.b.c=value` inside nested dicts, creating levels as needed; `a.b.c?=value` only
    when `a.b.c` is not set yet."""
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {override!r} must look like key.path=value")
    only_default = key.endswith("?")
    *parents, leaf = key.removesuffix("?").strip().split(".")
    node = data
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {part!r} is a value, not a section")
        node = child
    if only_default and leaf in node:
        return
    node[leaf] = yaml.safe_load(raw) if raw.strip() else ""


def resolve_path(path: str | Path) -> Path:
    """A config path as given, or a name in the shipped configs/ folder."""
    candidate = Path(path)
    for option in (candidate, CONFIG_DIR / candidate, CONFIG_DIR / f"{candidate}.yaml"):
        if option.is_file():
            return option
    shipped = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
    raise ConfigError(f"config {str(path)!r} not found (shipped configs: {shipped})")


def load_config(model: type[Model], path: str | Path | None = None, overrides: Sequence[str] = (),
                section: str | None = None) -> Model:
    """Validate YAML (optionally one `section` of it) plus overrides as `model`."""
    data: dict[str, Any] = {}
    if path is not None:
        loaded = yaml.safe_load(resolve_path(path).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
        data = loaded.get(section, {}) if section else loaded
    for override in overrides:
        apply_override(data, override)
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise ConfigError(f"invalid configuration{f' in {path}' if path else ''}:\n{error}") from error


def load_component_config(model: type[Model], path: str | Path | None, overrides: Sequence[str],
                          section: str) -> Model:
    """One component's settings (`section`: env, policy or learner) from a file of its own or
    from its section of a file that configures every component (as `sciproto train` writes).
    Overrides may name the section or not: `env.envs=[toy]` and `envs=[toy]` are the same."""
    use_section = None
    if path is not None:
        loaded = yaml.safe_load(resolve_path(path).read_text()) or {}
        if isinstance(loaded, dict) and isinstance(loaded.get(section), dict):
            use_section = section
    prefix = f"{section}."
    local = [o.removeprefix(prefix) if o.startswith(prefix) else o for o in overrides]
    return load_config(model, path, local, section=use_section)
