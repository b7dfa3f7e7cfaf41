"""The one place the server asks for environments by name.

    source = load_source("gsm8k")            # cheap: data loads on first use
    source.splits                            # {"train": 250, "test": 60}
    env = await source.make("train", 3)      # a fresh Aviary Environment, not yet reset
    obs, tools = await env.reset()
    ...
    await env.close()

Built-in names come first, then names a module of the user's registered (`register`, from a
module the server imports: `imports` in its config); any other name falls back to environments
Aviary itself knows (`TaskDataset.from_name`, then `Environment.from_name`).
"""

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from env_servers.envs.source import (
    FORK_COPY,
    FORK_REPLAY,
    FORK_UNSUPPORTED,
    UNBOUNDED,
    EnvironmentSource,
    ForkUnsupportedError,
    ReferenceUnsupportedError,
    RescoreUnsupportedError,
    reward_components,
)

# Options of one environment, as configured (env_options.NAME): text, or a list of names.
SourceOptions = dict[str, str | list[str]]


def _gsm8k(options: SourceOptions) -> EnvironmentSource:
    from env_servers.envs.gsm8k import GSM8kOptions, GSM8kSource

    return GSM8kSource(GSM8kOptions.model_validate(options))


def _notebook(options: SourceOptions) -> EnvironmentSource:
    # Imported lazily: the notebook stack (jupyter, litellm) takes seconds to import.
    from env_servers.envs.notebook import NotebookOptions, NotebookSource

    return NotebookSource(NotebookOptions.model_validate(options))


def _toy(options: SourceOptions) -> EnvironmentSource:
    from env_servers.envs.toy import ToyOptions, ToySource

    return ToySource(ToyOptions.model_validate(options))


_BUILTINS: dict[str, Callable[[SourceOptions], EnvironmentSource]] = {
    "gsm8k": _gsm8k,
    "notebook": _notebook,
    "toy": _toy,
}


# Sources registered by the modules named in a server's `imports`, by environment name.
_REGISTERED: dict[str, Callable[[SourceOptions], EnvironmentSource]] = {}


def builtin_names() -> list[str]:
    return sorted(_BUILTINS)


def register(name: str, factory: Callable[[SourceOptions], EnvironmentSource]) -> None:
    """Host `factory(options)` under `name`: called by a module of the user's that the server
    imports (`imports` in the env server's config), for an environment of its own."""
    if name in _BUILTINS:
        raise ValueError(f"{name!r} is a built-in environment; register yours under another name")
    _REGISTERED[name] = factory


def import_modules(imports: Sequence[str]) -> None:
    """Import each of `imports`, a module name or the path of a .py file (relative to the working
    directory), so that it can `register` its environments. Raises ValueError saying which
    could not be imported and why."""
    for entry in imports:
        try:
            if entry.endswith(".py"):
                path = Path(entry).resolve()
                if not path.is_file():
                    raise FileNotFoundError(f"no file {path}")
                # One module per file: files of the same name in two folders are two modules.
                name = f"sciproto_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
                if name in sys.modules:
                    continue
                spec = importlib.util.spec_from_file_location(name, path)
                assert spec is not None and spec.loader is not None
                module = importlib.util.module_from_spec(spec)
                sys.modules[name] = module
                try:
                    spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[name]
                    raise
            else:
                importlib.import_module(entry)
        except Exception as error:
            raise ValueError(f"imports: {entry!r} could not be imported: {type(error).__name__}: {error}") from error


def check_name(name: str) -> None:
    """Raise ValueError, saying what is available or what to install, unless `name` is a
    built-in, a registered name or an Aviary environment whose package is installed; builds nothing."""
    if name in _BUILTINS or name in _REGISTERED:
        return
    from env_servers.envs.aviary_registry import aviary_names, missing_package

    if (package := missing_package(name)) is not None:
        raise ValueError(f"environment {name!r} needs the package {package}, which is not installed:"
                         f" pip install {package} (into the environment sciproto runs from)")
    if name not in aviary_names():
        raise ValueError(
            f"unknown environment {name!r}; built-in environments: {builtin_names()};"
            f" registered by imports: {sorted(_REGISTERED)}; other names Aviary can build: {aviary_names()}"
        )


def load_source(name: str, options: SourceOptions | None = None) -> EnvironmentSource:
    """The environment source called `name`, configured by string `options`.

    Raises ValueError for an unknown name (listing what is available) or bad options.
    """
    options = dict(options or {})
    if name in _BUILTINS:
        return _BUILTINS[name](options)
    if name in _REGISTERED:
        return _REGISTERED[name](options)
    check_name(name)

    from aviary.env import TASK_DATASET_REGISTRY

    from env_servers.envs.aviary_registry import AviaryDatasetSource, AviaryEnvironmentSource

    if name in TASK_DATASET_REGISTRY:
        return AviaryDatasetSource(name, options)
    return AviaryEnvironmentSource(name, options)


__all__ = [
    "FORK_COPY",
    "FORK_REPLAY",
    "FORK_UNSUPPORTED",
    "UNBOUNDED",
    "EnvironmentSource",
    "ForkUnsupportedError",
    "ReferenceUnsupportedError",
    "RescoreUnsupportedError",
    "builtin_names",
    "check_name",
    "import_modules",
    "load_source",
    "register",
    "reward_components",
]
