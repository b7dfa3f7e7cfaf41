"""The import graph of the first-party packages: no circles, and no layer importing one above it.

Every import counts: at module level, inside a function, under `if TYPE_CHECKING:`, and
`importlib.import_module("literal.name")`. An import by a computed name (`import_module(name)`,
`__import__(name)`, `runpy.run_module(name)`) would hide an arrow from this graph, so it is refused;
the only ones allowed are the helpers in `NAMED_IMPORTERS`, which import a third party's or the
user's modules by name, and every call of theirs is checked to name no first-party module.
The layers, lowest first:

- the core, `sciproto/`, imports none of the other five packages; it holds the library every
  component shares: the clients (`sciproto.client`), the weight wire format (`sciproto.weights`)
  and model loading (`sciproto.models`);
- the servers, `env_servers/`, `policy_server/`, `learner/`, `gateway/`, import the core, never `clients/`
  and never another server;
- the applications, `clients/`, may import anything below them.

There are no exceptions: the command line is an application (`clients/cli.py`), and
`python -m sciproto` runs it through the distribution's console-script entry point.
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
COMPUTED_IMPORTS = {"import_module", "__import__", "run_module"}

# Functions that import a module whose name they are given, and why that name is never first-party.
# Those in `CHECKED_CALLERS` are called by first-party code: every call must pass a literal name
# outside the first-party packages (the others import what the user's command line names).
NAMED_IMPORTERS: dict[str, str] = {
    "sciproto.weights.vllm:import_vllm": "vLLM's modules, with a word on which extra to install",
    "learner.metrics:_optional_import": "an optional metrics package (tensorboard, wandb)",
    "clients.agent_zygote:serve": "the modules the user's agent program preloads",
    "clients.agent_zygote:_child": "the user's agent program (`python -m MODULE`)",
    "env_servers.catalog:import_modules": "the modules an env server's configuration names (`imports`)",
}
CHECKED_CALLERS = ("import_vllm", "_optional_import")


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
        elif (isinstance(node, ast.Call) and called_name(node) in COMPUTED_IMPORTS and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            yield node.args[0].value


def called_name(call: ast.Call) -> str | None:
    """`f` of `f(...)` and of `x.f(...)`."""
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def literal_name(call: ast.Call) -> str | None:
    first = call.args[0] if call.args else None
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def calls_by_function(tree: ast.Module, module: str) -> Iterator[tuple[str, ast.Call]]:
    """Every call in `tree`, with "module:function" of the outermost function it stands in
    ("module:Class.method" in a method, "module" outside any function)."""
    def visit(node: ast.AST, where: str, in_class: str | None) -> Iterator[tuple[str, ast.Call]]:
        for child in ast.iter_child_nodes(node):
            inner, inner_class = where, None
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) and where == module:
                inner = f"{module}:{in_class + '.' if in_class else ''}{child.name}"
            elif isinstance(child, ast.ClassDef) and where == module:
                inner_class = child.name
            if isinstance(child, ast.Call):
                yield where, child
            yield from visit(child, inner, inner_class)

    yield from visit(tree, module, None)


def build_named_imports() -> dict[str, list[str]]:
    """"computed": where a module is imported by a computed name ("module:function line N");
    "calls": the first argument of every call of a `NAMED_IMPORTERS` function, literal or "<computed>"."""
    computed: list[str] = []
    calls: list[str] = []
    for module, path in first_party_modules().items():
        tree = ast.parse(path.read_text(), str(path))
        for where, call in calls_by_function(tree, module):
            name = called_name(call)
            if name in COMPUTED_IMPORTS and call.args and literal_name(call) is None:
                computed.append(f"{where} line {call.lineno}")
            elif name in CHECKED_CALLERS and f"{module}:{name}" not in NAMED_IMPORTERS:
                given = literal_name(call) or ("<computed>" if call.args else "<default>")
                calls.append(f"{where} line {call.lineno}: {name}({given})")
    return {"computed": computed, "calls": calls}


@functools.cache
def built() -> dict:
    """`build_import_graph()` and `build_named_imports()`, run in a fresh interpreter: in a process
    where other tests ran, Python 3.11.7's `ast.parse` has failed with "SystemError: AST constructor
    recursion depth mismatch" (CPython gh-106905, a counter shared between threads; fixed in 3.11.8)."""
    run = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(run.stdout)


def import_graph() -> dict[str, set[str]]:
    return {module: set(targets) for module, targets in built()["graph"].items()}


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
    assert "learner.vllm_sync" in graph["learner.weight_push"]  # importlib.import_module("learner.vllm_sync")
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
    violations = sorted(f"{source} -> {target}: {why}" for source, targets in import_graph().items()
                        for target in targets if (why := layer_violation(source, target)) is not None)
    assert not violations, ("imports against the layers (move the shared code down instead):\n"
                            + "\n".join(violations))


def test_no_import_by_computed_name() -> None:
    computed = built()["computed"]
    hidden = [where for where in computed if where.rpartition(" line ")[0] not in NAMED_IMPORTERS]
    assert not hidden, ("imports by a computed name, which this graph cannot see (import the module by its "
                        "name, e.g. one branch per choice):\n" + "\n".join(hidden))
    gone = sorted(set(NAMED_IMPORTERS) - {where.rpartition(" line ")[0] for where in computed})
    assert not gone, f"these no longer import by a computed name; delete them from NAMED_IMPORTERS: {gone}"


def test_named_importers_are_given_no_first_party_name() -> None:
    first_party = [call for call in built()["calls"]
                   if call.endswith("(<computed>)") or call.rpartition("(")[2].split(".")[0] in PACKAGES]
    assert not first_party, "import helpers given a computed or first-party name:\n" + "\n".join(first_party)
    assert any("import_vllm(vllm." in call for call in built()["calls"])  # the check sees the calls


if __name__ == "__main__":
    print(json.dumps({"graph": {module: sorted(targets) for module, targets in build_import_graph().items()},
                      **build_named_imports()}))
