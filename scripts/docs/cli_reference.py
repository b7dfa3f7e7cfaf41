"""The command-line reference, written from the `sciproto` command's own help (clients/cli.py).

Each command gets its usage line, its help text, and a table of its arguments and options with
their defaults, as `sciproto COMMAND --help` states them. Typer's command objects are read by
their click-style attributes (Typer may bring its own copy of click).
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterator
from typing import Any


def context(command: Any, name: str) -> Any:
    return command.context_class(command, info_name=name)


def commands(group: Any, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every runnable command under `group`, in the order `--help` lists them."""
    if hasattr(group, "list_commands"):
        ctx = context(group, " ".join(("sciproto", *path)))
        for name in group.list_commands(ctx):
            sub = group.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                yield from commands(sub, (*path, name))
    else:
        yield path, group


def cell(text: str) -> str:
    return html.escape(re.sub(r"\s+", " ", text).strip(), quote=False).replace("|", "\\|")


def row(param: Any, ctx: Any) -> str | None:
    """One table row from the parameter's help record: names, its [bracketed] notes, its help."""
    record = param.get_help_record(ctx)
    if record is None:
        return None
    names, text = record
    # The bracketed notes click appends ([default: ...], [required]); brackets inside the help
    # itself ("PYTHON SCRIPT [ARGS]") are prose.
    tail = re.search(r"(?:\s*\[[^\]]+\])+\s*$", text)
    notes = re.findall(r"\[([^\]]+)\]", tail.group(0)) if tail else []
    text = text[:tail.start()] if tail else text
    shown = " ".join(f"`{word.rstrip(',')}`{',' * word.endswith(',')}" if word.startswith("-") else cell(word)
                     for word in names.split())
    if param.param_type_name == "argument":
        shown = f"`{names.split()[0].upper()}` " + cell(" ".join(names.split()[1:]))
    return f"| {shown} | {cell('; '.join(notes))} | {cell(text)} |"


def render_command(path: tuple[str, ...], command: Any) -> str:
    name = " ".join(("sciproto", *path))
    ctx = context(command, name)
    lines = [f"## `{name}` {{#{'-'.join(('cli', *path))}}}\n"]
    if command.help:
        lines.append(cell(command.help) + "\n")
    lines.append(f"```text\n{command.get_usage(ctx).removeprefix('Usage: ')}\n```\n")
    rows = [r for p in command.get_params(ctx) if p.name != "help" and (r := row(p, ctx)) is not None]
    if rows:
        lines += ["| argument or option | default | meaning |\n|---|---|---|", *rows, ""]
    return "\n".join(lines)


def cli_reference() -> str:
    """The Markdown of every `sciproto` command."""
    import typer

    from clients.cli import app

    root = typer.main.get_command(app)
    listed = list(commands(root, ()))
    # The commands a reader looks for first, in this order; the rest as --help lists them.
    first = ("train", "eval", "view", "collect", "serve", "conformance")
    listed.sort(key=lambda item: first.index(item[0][0]) if item[0][0] in first else len(first))
    return "\n".join(render_command(path, command) for path, command in listed)
