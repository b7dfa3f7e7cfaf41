"""`imports` in the env server's config: a module of the user's registers an environment of its
own (examples/letters_env.py, the tutorial's), and a bad entry is refused saying which and why."""

from __future__ import annotations

from pathlib import Path

import pytest

from env_servers.catalog import check_name, import_modules, load_source, register
from sciproto.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]


async def test_a_registered_environment_is_hosted_like_a_builtin() -> None:
    import_modules([str(ROOT / "examples/letters_env.py")])
    check_name("letters")
    source = load_source("letters")
    assert source.splits == {"train": 200, "test": 40}
    env = await source.make("test", 0)
    observations, _ = await env.reset()
    assert "How many letters" in observations[0].content
    reference = source.reference_actions("test", 0)
    _, reward, terminated, _ = await env.step(reference[0])
    assert reward == 1.0 and terminated


def test_a_bad_import_names_itself_and_the_cause(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"'nowhere/env\.py' could not be imported: FileNotFoundError"):
        import_modules(["nowhere/env.py"])
    broken = tmp_path / "broken_env.py"
    broken.write_text("raise RuntimeError('the dataset is missing')\n")
    with pytest.raises(ValueError, match="RuntimeError: the dataset is missing"):
        import_modules([str(broken)])
    with pytest.raises(ValueError, match="no_such_module_46"):
        import_modules(["no_such_module_46"])


def test_a_builtin_name_cannot_be_registered() -> None:
    with pytest.raises(ValueError, match="built-in"):
        register("toy", lambda options: load_source("toy"))


def test_the_env_server_refuses_a_bad_import_as_a_config_error() -> None:
    from env_servers.app import load_sources
    from env_servers.config import EnvServerConfig

    with pytest.raises(ConfigError, match="missing_env.py"):
        load_sources(EnvServerConfig(envs=["toy"], imports=["missing_env.py"]))


def test_files_of_the_same_name_in_two_folders_are_both_imported(tmp_path: Path) -> None:
    for folder, name in (("first", "same_stem_one"), ("second", "same_stem_two")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "envs.py").write_text(
            "from env_servers.catalog import load_source, register\n"
            f"register({name!r}, lambda options: load_source('toy'))\n")
    import_modules([str(tmp_path / "first/envs.py"), str(tmp_path / "second/envs.py")])
    check_name("same_stem_one")
    check_name("same_stem_two")
