"""The one place the server asks for environments by name.

    source = load_source("gsm8k")            # cheap: data loads on first use
    source.splits                            # {"train": 250, "test": 60}
    env = await source.make("train", 3)      # a fresh Aviary Environment, not yet reset
    obs, tools = await env.reset()
    ...
    await env.close()

Built-in names come first; any other name falls back to environments Aviary itself knows
(`TaskDataset.from_name`, then `Environment.from_name`).
"""

from collections.abc import Callable

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


def builtin_names() -> list[str]:
    return sorted(_BUILTINS)


def check_name(name: str) -> None:
    """Raise ValueError, saying what is available or what to install, unless `name` is a
    built-in or an Aviary environment whose package is installed; builds nothing."""
    if name in _BUILTINS:
        return
    from env_servers.envs.aviary_registry import aviary_names, missing_package

    if (package := missing_package(name)) is not None:
        raise ValueError(f"environment {name!r} needs the package {package}, which is not installed:"
                         f" pip install {package} (into the environment sciproto runs from)")
    if name not in aviary_names():
        raise ValueError(
            f"unknown environment {name!r}; built-in environments: {builtin_names()};"
            f" other names Aviary can build: {aviary_names()}"
        )


def load_source(name: str, options: SourceOptions | None = None) -> EnvironmentSource:
    """The environment source called `name`, configured by string `options`.

    Raises ValueError for an unknown name (listing what is available) or bad options.
    """
    options = dict(options or {})
    if name in _BUILTINS:
        return _BUILTINS[name](options)
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
    "load_source",
    "reward_components",
]
