"""Sources for any environment Aviary itself knows by name (TaskDataset.from_name and
Environment.from_name), used when a name is not one of the built-ins."""

import asyncio
import importlib.util
from collections.abc import Mapping

from aviary.core import Environment, TaskDataset
from aviary.env import ENV_REGISTRY, TASK_DATASET_REGISTRY

from env_servers.envs.source import UNBOUNDED, EnvironmentSource, require_fields

# Split name used when the options name no splits: the dataset is built without a split argument.
DEFAULT_SPLIT = "default"


def aviary_names() -> list[str]:
    """Every name Aviary can build here, as a dataset or as a single environment: registered
    names whose package is installed (Aviary registers some, such as hotpotqa, that it cannot
    import until their package is installed)."""
    return sorted(name for name in TASK_DATASET_REGISTRY.keys() | ENV_REGISTRY.keys()
                  if missing_package(name) is None)


def missing_package(name: str) -> str | None:
    """The PyPI package that provides Aviary environment `name`, when it is not installed."""
    for registry in (TASK_DATASET_REGISTRY, ENV_REGISTRY):
        if name in registry:
            module = registry[name][0]
            try:
                if importlib.util.find_spec(module) is not None:
                    return None
            except ImportError:
                pass
            parts = module.split(".")  # aviary.envs.<name>.env comes from the package aviary.<name>
            return f"aviary.{parts[2]}" if parts[:2] == ["aviary", "envs"] and len(parts) > 2 else "fhaviary"
    return None


class AviaryDatasetSource(EnvironmentSource):
    """Tasks from `TaskDataset.from_name(name, split=<split>, **kwargs)`.

    Options: "splits" (comma-separated split names passed as `split=`; without it there is one
    split, "default", built with no split argument); every other option is passed to the
    dataset's constructor as a string keyword argument. Datasets are built on first use.
    """

    def __init__(self, name: str, options: Mapping[str, str]) -> None:
        self.name = name
        self.description = f"Aviary task dataset {name!r} (TaskDataset.from_name)"
        self._kwargs = {key: value for key, value in options.items() if key != "splits"}
        split_names = [s.strip() for s in options.get("splits", "").split(",") if s.strip()]
        self._split_names = split_names or [DEFAULT_SPLIT]
        self._datasets: dict[str, TaskDataset] = {}

    def _dataset(self, split: str) -> TaskDataset:
        if split not in self._datasets:
            split_kwargs = {} if split == DEFAULT_SPLIT else {"split": split}
            self._datasets[split] = TaskDataset.from_name(self.name, **split_kwargs, **self._kwargs)
        return self._datasets[split]

    @property
    def splits(self) -> dict[str, int]:
        """Builds every dataset on first access, which may be slow for large datasets."""
        sizes = {}
        for split in self._split_names:
            try:
                sizes[split] = len(self._dataset(split))
            except TypeError:  # Aviary's signal for a dataset without a length
                sizes[split] = UNBOUNDED
        return sizes

    async def _make_checked(self, split: str, index: int) -> Environment:
        dataset = self._dataset(split)
        if self.splits[split] == UNBOUNDED:
            return await asyncio.to_thread(dataset.get_new_env)
        return await asyncio.to_thread(dataset.get_new_env_by_idx, index)

    async def make_inline(self, task: dict[str, str]) -> Environment:
        """Fields go to the dataset's get_new_env_by_args, Aviary's hook for inline tasks."""
        dataset = self._dataset(self._split_names[0])
        try:
            return await asyncio.to_thread(dataset.get_new_env_by_args, **task)
        except NotImplementedError as exc:
            raise ValueError(
                f"Aviary dataset {self.name!r} does not take inline tasks: {exc}"
            ) from exc
        except TypeError as exc:
            raise ValueError(f"bad inline task fields for {self.name!r}: {exc}") from exc

    def _summary_checked(self, split: str, index: int) -> dict[str, str]:
        return {"source": self.name, "split": split, "index": str(index)}


class AviaryEnvironmentSource(EnvironmentSource):
    """A single Aviary environment class with no dataset: inline tasks only, built with
    `Environment.from_name(name, task=<question>)`."""

    def __init__(self, name: str, options: Mapping[str, str]) -> None:
        if options:
            raise ValueError(f"Aviary environment {name!r} takes no options, got {sorted(options)}")
        self.name = name
        self.description = f"Aviary environment {name!r} (Environment.from_name); inline tasks only"

    @property
    def splits(self) -> dict[str, int]:
        return {}

    async def _make_checked(self, split: str, index: int) -> Environment:
        raise AssertionError("check_task rejects every split of a source without splits")

    async def make_inline(self, task: dict[str, str]) -> Environment:
        require_fields(self.name, task, {"question"})
        try:
            return Environment.from_name(self.name, task=task["question"])
        except NotImplementedError as exc:
            raise ValueError(
                f"Aviary environment {self.name!r} cannot be built from a task text"
            ) from exc

    def _summary_checked(self, split: str, index: int) -> dict[str, str]:
        raise AssertionError("check_task rejects every split of a source without splits")
