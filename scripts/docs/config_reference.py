"""The configuration reference, written from the pydantic models the components load.

Every key gets its default and its meaning: the field's `description`, else the comment lines
right above the field in the model's source. A model used in several places (`server`, `auth`,
`tracing`, ...) is written out once; later places link to it.
"""

from __future__ import annotations

import ast
import html
import inspect
import json
import re
import textwrap
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, TypeAdapter
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Section:
    """One model written out as a table under the key path `key`."""

    key: str
    anchor: str
    model: type[BaseModel]
    rows: list[tuple[str, str, str, str]] = field(default_factory=list)  # key, type, default, meaning


def source_comments(model: type[BaseModel]) -> dict[str, str]:
    """The comment block right above each field of `model`'s class body, by field name.

    A field with none shares the block of the field right before it (no blank line between)
    when the block names it, or when the two names share their first or last word
    (`policy_threads` after `learner_threads`, `eps_high` after `eps_low`).
    """
    try:
        lines, _ = inspect.getsourcelines(model)
    except (OSError, TypeError):
        return {}
    body = ast.parse(textwrap.dedent("".join(lines))).body[0]
    assert isinstance(body, ast.ClassDef)
    found: dict[str, str] = {}
    previous: tuple[str, int] | None = None  # the last field: its name and its last line
    for statement in body.body:
        if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
            previous = None
            continue
        name = statement.target.id
        comment: list[str] = []
        index = statement.lineno - 2  # the line above, 0-based
        while index >= 0 and lines[index].strip().startswith("#"):
            comment.insert(0, lines[index].strip().lstrip("#").strip())
            index -= 1
        if comment:
            found[name] = " ".join(comment)
        elif previous is not None and previous[0] in found and previous[1] == statement.lineno - 1:
            before, block = previous[0], found[previous[0]]
            words, before_words = name.split("_"), before.split("_")
            related = len(words) > 1 and (words[0] == before_words[0] or words[-1] == before_words[-1])
            if related or re.search(rf"\b{re.escape(name)}\b", block):
                found[name] = block
        previous = (name, statement.end_lineno or statement.lineno)
    return found


def nested_model(annotation: Any) -> tuple[type[BaseModel] | None, str]:
    """The model a field holds (directly, optionally, or as list items), and the key suffix."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, ""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        if len(models) == 1 and len(args) == 2 and type(None) in args:
            return models[0], ""
    if origin is list and len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return args[0], "[]"
    return None, ""


def type_text(annotation: Any) -> str:
    """A short name of a field's type, as a YAML author reads it."""
    if annotation is type(None):
        return "null"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return " \\| ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(type_text(a) for a in args)
    if origin is typing.Annotated:
        return type_text(args[0])
    if origin in (list, tuple, set, frozenset):
        return f"list of {type_text(args[0])}" if args else "list"
    if origin is dict:
        return f"map of {type_text(args[1])}" if len(args) == 2 else "map"
    names = {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "Path": "path", "Any": "any"}
    name = getattr(annotation, "__name__", str(annotation))
    return names.get(name, name)


def default_text(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    value = info.get_default(call_default_factory=True)
    if value is PydanticUndefined:
        return "required"
    try:
        dumped = TypeAdapter(info.annotation).dump_python(value, mode="json")
    except Exception:  # noqa: BLE001 - a default pydantic cannot dump is shown as Python writes it
        dumped = value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)
    if isinstance(value, Path) and value.is_relative_to(ROOT):
        dumped = str(value.relative_to(ROOT))  # a folder of the source tree, wherever it is built
    return f"`{json.dumps(dumped)}`"


def prose(text: str) -> str:
    """`text` on one line, safe in a Markdown table: `<`, `>` and `&` outside code spans escaped."""
    fence = "\0"  # a ``` in the text is shown as written, not read as a code span
    parts = re.sub(r"\s+", " ", text).strip().replace("```", fence).split("`")
    parts[::2] = [html.escape(part, quote=False) for part in parts[::2]]
    return "`".join(parts).replace(fence, "&#96;" * 3).replace("|", "\\|")


def meaning_text(name: str, info: FieldInfo, comments: dict[str, str]) -> str:
    return prose(info.description or comments.get(name, ""))


def anchor(namespace: str, key: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", f"{namespace} {key}".lower()).strip("-")


Seen = dict[type[BaseModel], tuple[str, str]]  # model -> (key, anchor) where it is written out


def sections(namespace: str, key: str, model: type[BaseModel], seen: Seen) -> Iterator[Section]:
    """`model` under `key`, then each model it holds, depth first; shared models once."""
    section = Section(key, anchor(namespace, key or "top"), model)
    seen.setdefault(model, (key, section.anchor))
    comments = source_comments(model)
    children: list[tuple[str, type[BaseModel]]] = []
    for name, info in model.model_fields.items():
        child_key = f"{key}.{name}" if key else name
        held, suffix = nested_model(info.annotation)
        meaning = meaning_text(name, info, comments)
        if held is not None:
            if held not in seen:
                seen[held] = (child_key + suffix, anchor(namespace, child_key + suffix))
                children.append((child_key + suffix, held))
            target, target_anchor = seen[held]
            optional = not info.is_required() and info.get_default() is None
            note = "; absent unless set" if optional else ""
            link = f"see [`{target}`](#{target_anchor})"
            section.rows.append((f"`{child_key}{suffix}`", "section", "", f"{meaning}{note} ({link})".lstrip("; ")))
            continue
        section.rows.append((f"`{child_key}`", type_text(info.annotation), default_text(info), meaning))
    yield section
    for child_key, held in children:
        yield from sections(namespace, child_key, held, seen)


def render(namespace: str, model: type[BaseModel], seen: Seen, level: int = 3, title: str = "") -> str:
    """`model`'s keys and those of every model it holds; `title` names its own table (default:
    the top level of a file)."""
    out: list[str] = []
    for section in sections(namespace, "", model, seen):
        heading = f"`{section.key}`" if section.key else (f"`{title}`" if title else "Top level")
        out.append(f"{'#' * level} {heading} {{#{section.anchor}}}\n")
        doc = section.model.__dict__.get("__doc__")  # its own, not BaseModel's
        if doc:
            out.append(prose(doc) + "\n")
        out.append("| key | type | default | meaning |\n|---|---|---|---|")
        out += [f"| {k} | {t} | {d} | {m} |" for k, t, d, m in section.rows]
        out.append("")
    return "\n".join(out)


def configuration_reference() -> str:
    """The Markdown of every config the `sciproto` commands read."""
    from clients.collect import CollectConfig
    from clients.eval import EvalConfig
    from clients.train import TrainConfig
    from env_servers.envs.gsm8k import GSM8kOptions
    from env_servers.envs.notebook import NotebookEpisodeOptions, NotebookOptions

    seen: Seen = {}
    return "\n".join([
        "## `sciproto train` and `sciproto serve` {#train-config}\n",
        ("The file `sciproto train --config FILE` reads. `sciproto serve env|policy|learner` reads its "
         "own section of the same file (`env`, `policy` or `learner`), and its `--set` takes the keys "
         "with or without the section's name.\n"),
        render("train", TrainConfig, seen),
        "## `sciproto collect` {#collect-config}\n",
        ("`sciproto collect --config FILE` reads these keys at the top level of its file; sections "
         "written out above are linked.\n"),
        render("collect", CollectConfig, seen),
        "## `sciproto eval` {#eval-config}\n",
        "`sciproto eval --config FILE` reads these keys at the top level of its file.\n",
        render("eval", EvalConfig, seen),
        "## Environment options {#env-options}\n",
        ("`env.env_options.NAME` holds the options of the built-in environment NAME, given when the "
         "server starts (`toy` takes none). Values are written as text, or as a list of names where "
         "the option takes one, and checked against these models.\n"),
        render("gsm8k", GSM8kOptions, seen, title="env.env_options.gsm8k"),
        render("notebook", NotebookOptions, seen, title="env.env_options.notebook"),
        "## Per-episode options of the notebook {#episode-options}\n",
        ("Sent with each Reset (`ResetRequest.options`; `rollout.reset_options` and "
         "`rollout.observation` in a config); every other built-in environment refuses options.\n"),
        render("episode", NotebookEpisodeOptions, seen, title="rollout.reset_options"),
    ])
