"""Every `sciproto ...` and `scripts/...` command in README.md and the documentation site
(docs/**/*.md), as written there, must parse:
its options (the CLI's parser, with --help) and its config (the file and every --set key,
validated as the command would). Placeholders in the command table (HOST:PORT, FILE,
env|policy|learner) stand for real values; a `--set key=FILE` naming the reader's own file is
left out of the config check. The quick ones also run."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from clients.cli import app
from sciproto.processes import sciproto_command, start_server

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"```bash\n(.*?)```", re.DOTALL)
INLINE = re.compile(r"`((?:sciproto|scripts/)[a-z./]* [^`]*|scripts/[a-z_-]+\.sh)`")
PLACEHOLDERS = {"HOST:PORT": "127.0.0.1:50051", "FILE": "configs/demo.yaml", "key.path=value": "tracing.exporter=none",
                "key=value": "tracing.exporter=none", "/path/to/hf-model": "tiny", "X": "env", "K": "8",
                "COMMAND": "train"}


def page_commands(page: Path) -> list[str]:
    text = page.read_text().replace("\\|", "|")  # `a\|b` in a table cell
    found: list[str] = []
    for block in BLOCK.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line.startswith(("sciproto ", "scripts/")):
                found.append(line)
    for inline in INLINE.findall(text):
        if "|" in inline:  # `sciproto serve env|policy|learner`: each of them
            head, alternatives = re.match(r"(.*?)(\S+\|\S+)", inline).groups()  # type: ignore[union-attr]
            rest = inline[len(head) + len(alternatives):]
            found += [f"{head}{choice}{rest}" for choice in alternatives.split("|")]
        else:
            found.append(inline)
    return [" ".join(PLACEHOLDERS.get(word, word) for word in command.split()) for command in found]


COMMANDS_BY_PAGE = {page: page_commands(page) for page in PAGES}
COMMANDS = list(dict.fromkeys(c for commands in COMMANDS_BY_PAGE.values() for c in commands))  # README's first


def test_the_readme_has_commands_to_check() -> None:
    readme = COMMANDS_BY_PAGE[README]
    assert any(c.startswith("scripts/demo.sh") for c in readme)
    assert any(c.startswith("scripts/test.sh") for c in readme)
    assert any(c.startswith("sciproto train") for c in COMMANDS)
    assert any(c.startswith("sciproto serve env") for c in COMMANDS)


def test_every_docs_page_with_commands_is_read() -> None:
    """The guides show commands; a page whose commands this test cannot see would go unchecked."""
    for page in ("getting-started.md", "guides/train.md", "guides/host-an-env.md", "guides/evaluate.md"):
        assert COMMANDS_BY_PAGE[ROOT / "docs" / page], f"no command found in docs/{page}"


def options(argv: list[str], name: str) -> list[str]:
    return [argv[i + 1] for i, word in enumerate(argv[:-1]) if word == name]


def check_config(argv: list[str]) -> None:
    """Load the config the command would load, with its --config and --set (raises if invalid)."""
    from sciproto.config import load_component_config, load_config

    config = (options(argv, "--config") or options(argv, "-c") or [None])[0]
    # `--set key=FILE` names a file of the reader's: its key is still checked, by the CLI parse
    # above; its value cannot be.
    sets = [s for s in options(argv, "--set") if not re.fullmatch(r"[A-Z]+", s.partition("=")[2])]
    if argv[:1] == ["train"]:
        from clients.train import load_train_config

        load_train_config(config or "demo", sets)
    elif argv[:1] == ["serve"] and len(argv) > 1:
        component = argv[1]
        if component == "env":
            from env_servers.config import EnvServerConfig as model
            sets += [f"envs=[{','.join(options(argv, '--env'))}]"] if "--env" in argv else []
        elif component == "policy":
            from policy_server.config import PolicyServerConfig as model
        elif component == "learner":
            from learner.server_config import LearnerServerConfig as model
        else:
            return  # the gateway takes options only, checked by the parse above
        load_component_config(model, config, sets, component)
    elif argv[:1] == ["collect"]:
        from clients.collect import CollectConfig

        load_config(CollectConfig, config, sets)


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command_parses(command: str) -> None:
    argv = shlex.split(command)
    if argv[0].startswith("scripts/"):
        script = ROOT / argv[0]
        assert script.is_file() and os.access(script, os.X_OK), f"{argv[0]} is not an executable script"
        if argv[0] != "scripts/demo.sh":
            return
        argv = ["sciproto", "train", "--config", "demo", *argv[1:]]  # what demo.sh runs
    assert argv[0] == "sciproto"
    parsed = CliRunner().invoke(app, [*argv[1:], "--help"])
    assert parsed.exit_code == 0, f"{command}: {parsed.output}"
    check_config(argv[1:])


@pytest.mark.timeout(300)
def test_quick_readme_commands_run(tmp_path: Path) -> None:
    version = subprocess.run(sciproto_command("version"), capture_output=True, text=True, timeout=60, check=False)
    assert version.returncode == 0 and "protocol" in version.stdout
    serve = next(c for c in COMMANDS if c.startswith("sciproto serve env --env"))
    server = start_server([*shlex.split(serve)[1:], "--port", "0"], timeout_s=180)
    try:
        for command in (c for c in COMMANDS if c == "sciproto describe 127.0.0.1:50051"):
            argv = shlex.split(command.replace("127.0.0.1:50051", server.target))
            described = subprocess.run(sciproto_command(*argv[1:]), capture_output=True, text=True, timeout=60,
                                       check=False)
            assert described.returncode == 0 and '"toy"' in described.stdout, described.stderr
    finally:
        server.stop()
