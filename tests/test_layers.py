"""The import graph of the first-party packages: no circles, and no layer importing one above it.

Every import counts: at module level, inside a function, under `if TYPE_CHECKING:`, and
`importlib.import_module("literal.name")`. The layers, lowest first:

- the core, `sciproto/`, imports none of the other five packages; it holds the library every
  component shares: the clients (`sciproto.client`), the weight wire format (`sciproto.weights`)
  and model loading (`sciproto.models`);
- the servers, `env_servers/`, `policy_server/`, `learner/`, `gateway/`, import the core, never `clients/`
  and never another server;
- the applications, `clients/`, may import anything below them.

`EXCEPTIONS` lists the imports that break these rules today, each with the reason. It may only
shrink: an import not listed fails, and so does a listed one that is gone (delete its line).
"""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sciproto", "clients", "env_servers", "policy_server", "learner", "gateway")
SERVERS = ("env_servers", "policy_server", "learner", "gateway")

EXCEPTIONS: dict[tuple[str, str], str] = {
    # The command line dispatches to every component; it imports each only when its sub-command runs.
    ("sciproto.cli", "clients.collect"): "command line",
    ("sciproto.cli", "clients.demonstrations"): "command line",
    ("sciproto.cli", "clients.eval"): "command line",
    ("sciproto.cli", "clients.train"): "command line",
    ("sciproto.cli", "clients.viewer"): "command line",
    ("sciproto.cli", "gateway.app"): "command line",
    ("sciproto.cli", "clients.agent_command"): "command line",
    ("sciproto.cli", "env_servers.workers"): "command line",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def first_party_modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
            if "_proto" not in path.parts}


def imported_names(path: Path, module: str) -> Iterator[str]:
    """Every dotted name `path` imports, wherever the import statement stands."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            yield node.args[0].value


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """`build_import_graph()`, run in a fresh interpreter: in a process where other tests ran,
    Python 3.11.7's `ast.parse` has failed with "SystemError: AST constructor recursion depth
    mismatch" (CPython gh-106905, a counter shared between threads; fixed in 3.11.8)."""
    built = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=120, check=True)
    return {module: set(targets) for module, targets in json.loads(built.stdout).items()}


def build_import_graph() -> dict[str, set[str]]:
    """Module -> the first-party modules it imports (a name resolves to its longest module prefix)."""
    modules = first_party_modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = {resolve(name) for name in imported_names(path, module) if name.split(".")[0] in PACKAGES}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def layer_violation(source: str, target: str) -> str | None:
    """Why `source` may not import `target`, or None when it may."""
    low, high = source.split(".")[0], target.split(".")[0]
    if low == "sciproto" and high != "sciproto":
        return "the core imports no other package"
    if low in SERVERS and high == "clients":
        return "a server imports nothing of clients/"
    if low in SERVERS and high in SERVERS and high != low:
        return "a server imports no other server"
    return None


def test_the_graph_sees_every_kind_of_import() -> None:
    graph = import_graph()
    assert "clients.train" in graph["sciproto.cli"]  # importlib.import_module("clients.train")
    assert "learner.collective_push" in graph["learner.weight_push"]  # inside a function
    assert "sciproto.processes" in graph["clients.train.processes"]  # module level
    assert "learner.server_config" in graph["clients.train.processes"]  # under TYPE_CHECKING


def test_circles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert circles(graph) == [["a", "b", "c"]]


def test_layer_rules() -> None:
    assert layer_violation("sciproto.client.replicas", "clients.agent")
    assert layer_violation("sciproto.client.rollouts", "learner.grpo")
    assert layer_violation("sciproto.weights.wire", "policy_server.types")
    assert layer_violation("env_servers.service", "clients.collect")
    assert layer_violation("learner.weight_push", "policy_server.service")
    assert layer_violation("learner.trainer", "env_servers.config")
    assert layer_violation("sciproto.client.replicas", "sciproto.client.retries") is None
    assert layer_violation("learner.app", "sciproto.client.policy") is None
    assert layer_violation("clients.train", "learner.server_config") is None
    assert layer_violation("learner.service", "sciproto.errors") is None


def test_no_import_circles() -> None:
    found = circles(import_graph())
    assert not found, "import circles (modules that import each other round a loop): " + "; ".join(
        " <-> ".join(circle) for circle in found)


def test_no_layer_imports_one_above_it() -> None:
    violations = sorted((source, target, why) for source, targets in import_graph().items() for target in targets
                        if (why := layer_violation(source, target)) is not None)
    new = [f"{source} -> {target}: {why}" for source, target, why in violations
           if (source, target) not in EXCEPTIONS]
    assert not new, "imports against the layers (move the shared code down instead):\n" + "\n".join(new)
    gone = sorted(set(EXCEPTIONS) - {(source, target) for source, target, _ in violations})
    assert not gone, f"these exceptions no longer occur; delete them from EXCEPTIONS: {gone}"


if __name__ == "__main__":
    print(json.dumps({module: sorted(targets) for module, targets in build_import_graph().items()}))
