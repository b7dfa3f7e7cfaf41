"""proto/README.md is the reference an implementer works from: its catalogue of ErrorInfo
reasons and its role table must say what the servers do. Read from the servers' source (every
`raise SomeError(..., Reason.X)`) and from `sciproto.auth.METHOD_ROLES`."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import grpc

from sciproto import errors
from sciproto.auth import METHOD_ROLES

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "proto" / "README.md"
SERVER_PACKAGES = ("sciproto", "env_servers", "policy_server", "learner")
# The client library raises errors on the caller's side (no healthy replica, a local deadline):
# they never travel as a server's status.
CLIENT_SIDE = ROOT / "sciproto" / "client"
ROW = re.compile(r"^\| `([A-Z_]+)` \| ([^|]+) \|")

# Exception classes of sciproto.errors -> the gRPC code they carry.
ERROR_CODES = {name: cls.code.name for name, cls in vars(errors).items()
               if isinstance(cls, type) and issubclass(cls, errors.SciprotoError) and cls is not errors.SciprotoError}


def documented_reasons() -> dict[str, set[str]]:
    """reason -> gRPC codes, from the reference page's table of reasons."""
    text = REFERENCE.read_text()
    table = text[text.index("### Reasons"):text.index("## request_id")]
    rows = (ROW.match(line) for line in table.splitlines())
    return {row.group(1): set(re.findall(r"`([A-Z_]+)`", row.group(2))) for row in rows if row}


def raised_reasons() -> dict[str, set[tuple[str, str]]]:
    """reason -> {(gRPC code, where)} for every error the servers construct with a Reason."""
    found: dict[str, set[tuple[str, str]]] = {}
    for package in SERVER_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "_proto" in path.parts or path.is_relative_to(CLIENT_SIDE):
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and node.func.id in ERROR_CODES):
                    continue
                for argument in [*node.args, *(keyword.value for keyword in node.keywords)]:
                    # `Reason.X`, or `Reason.X if ... else Reason.Y`
                    choices = [argument.body, argument.orelse] if isinstance(argument, ast.IfExp) else [argument]
                    for choice in choices:
                        if (isinstance(choice, ast.Attribute) and isinstance(choice.value, ast.Name)
                                and choice.value.id == "Reason"):
                            where = f"{path.relative_to(ROOT)}:{node.lineno}"
                            found.setdefault(choice.attr, set()).add((ERROR_CODES[node.func.id], where))
    return found


def test_every_reason_the_servers_raise_is_documented_with_its_code() -> None:
    documented, raised = documented_reasons(), raised_reasons()
    assert len(raised) >= 15, f"the scan found too few raises to be reading the code: {sorted(raised)}"
    problems = [
        f"{reason} raised as {code} at {where}, but proto/README.md lists it "
        + (f"with {sorted(documented[reason])}" if reason in documented else "nowhere")
        for reason, uses in sorted(raised.items()) for code, where in sorted(uses)
        if code not in documented.get(reason, set())
    ]
    assert not problems, "\n".join(problems)


def test_every_documented_reason_is_one_the_servers_raise() -> None:
    """Reason by reason (a code may be chosen at run time, `kind(..., Reason.X)`, which the scan
    cannot follow)."""
    documented, raised = documented_reasons(), raised_reasons()
    assert set(documented) <= {reason.value for reason in errors.Reason}, "a documented reason is not in Reason"
    stale = sorted(set(documented) - set(raised))
    assert not stale, f"proto/README.md lists reasons no server raises: {stale}"


def test_every_documented_code_is_a_grpc_code() -> None:
    codes = {code for codes in documented_reasons().values() for code in codes}
    assert codes <= {code.name for code in grpc.StatusCode}


def test_role_table_matches_method_roles() -> None:
    text = REFERENCE.read_text()
    table = text[text.index("## Roles"):text.index("## Notes for implementers")]
    documented: dict[str, str] = {}
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) != 3 or not cells[0].endswith("Service"):
            continue
        service, methods, role = cells
        for method in methods.split(", "):
            documented[f"/sciproto.v1.{service}/{method}"] = role.split()[0]
    expected = {method: role.value for method, role in METHOD_ROLES.items() if method.startswith("/sciproto.v1.")}
    assert documented == expected
