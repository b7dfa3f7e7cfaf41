"""The protocol reference, written from the contracts in proto/sciproto/v1/ and their comments.

protoc (grpcio-tools) compiles the files with their source info; every service, method,
message, field, enum and value is written out with the comment above it in the .proto file.
"""

from __future__ import annotations

import html
import re
import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = ROOT / "proto"
PACKAGE_NAME = "sciproto.v1"

# Field numbers in descriptor.proto that SourceCodeInfo paths use.
PACKAGE, MESSAGE, ENUM, SERVICE = 2, 4, 5, 6
FIELD, NESTED_MESSAGE, NESTED_ENUM = 2, 3, 4
ENUM_VALUE, METHOD = 2, 2

TYPE_NAMES = {
    value: name.removeprefix("TYPE_").lower()
    for name, value in descriptor_pb2.FieldDescriptorProto.Type.items()
}


def compile_protos() -> descriptor_pb2.FileDescriptorSet:
    from grpc_tools import protoc

    files = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "sciproto").rglob("*.proto"))
    well_known = Path(protoc.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "set.binpb"
        args = ["protoc", f"-I{PROTO_ROOT}", f"-I{well_known}", "--include_source_info",
                f"--descriptor_set_out={out}", *files]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc could not compile {files}")
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def cell(text: str) -> str:
    parts = re.sub(r"\s+", " ", text).strip().split("`")
    parts[::2] = [html.escape(part, quote=False) for part in parts[::2]]
    return "`".join(parts).replace("|", "\\|")


class Comments:
    def __init__(self, file: descriptor_pb2.FileDescriptorProto) -> None:
        self.by_path = {tuple(loc.path): loc.leading_comments for loc in file.source_code_info.location}

    def __call__(self, *path: int) -> str:
        return cell(self.by_path.get(path, ""))


def field_type(field: descriptor_pb2.FieldDescriptorProto,
               maps: dict[str, descriptor_pb2.DescriptorProto] | None = None) -> str:
    """The field's type, linked to its own entry when it is one of ours."""
    entry = (maps or {}).get(field.type_name.rsplit(".", 1)[-1])
    if entry is not None:
        key, value = entry.field
        return f"map&lt;{field_type(key).strip('`')}, {field_type(value)}&gt;"
    repeated = "repeated " if field.label == descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED else ""
    if not field.type_name:
        return f"`{repeated}{TYPE_NAMES[field.type]}`"
    if field.type_name.startswith(f".{PACKAGE_NAME}."):
        name = field.type_name.removeprefix(f".{PACKAGE_NAME}.")
        return f"{repeated}[`{name}`](#{anchor(name)})"
    return f"`{repeated}{field.type_name.lstrip('.')}`"


def render_message(message: descriptor_pb2.DescriptorProto, comments: Comments, path: tuple[int, ...],
                   prefix: str = "") -> list[str]:
    name = prefix + message.name
    if message.options.map_entry:
        return []
    lines = [f"#### `{name}` {{#{anchor(name)}}}\n"]
    if text := comments(*path):
        lines.append(text + "\n")
    oneofs = [o.name for o in message.oneof_decl]
    maps = {nested.name: nested for nested in message.nested_type if nested.options.map_entry}
    if message.field:
        lines.append("| field | type | number | meaning |\n|---|---|---|---|")
        for index, field in enumerate(message.field):
            oneof = (f" (one of `{oneofs[field.oneof_index]}`)"
                     if field.HasField("oneof_index") and not field.proto3_optional else "")
            lines.append(f"| `{field.name}` | {field_type(field, maps)} | {field.number} | "
                         f"{comments(*path, FIELD, index)}{oneof} |")
        lines.append("")
    for index, nested in enumerate(message.nested_type):
        lines += render_message(nested, comments, (*path, NESTED_MESSAGE, index), f"{name}.")
    for index, enum in enumerate(message.enum_type):
        lines += render_enum(enum, comments, (*path, NESTED_ENUM, index), f"{name}.")
    return lines


def render_enum(enum: descriptor_pb2.EnumDescriptorProto, comments: Comments, path: tuple[int, ...],
                prefix: str = "") -> list[str]:
    name = prefix + enum.name
    lines = [f"#### `{name}` (enum) {{#{anchor(name)}}}\n"]
    if text := comments(*path):
        lines.append(text + "\n")
    lines.append("| value | number | meaning |\n|---|---|---|")
    lines += [f"| `{value.name}` | {value.number} | {comments(*path, ENUM_VALUE, index)} |"
              for index, value in enumerate(enum.value)]
    return [*lines, ""]


def anchor(name: str) -> str:
    return "pb-" + re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def render_file(file: descriptor_pb2.FileDescriptorProto) -> str:
    comments = Comments(file)
    lines = [f"## `{file.name}` {{#{anchor(Path(file.name).stem)}-file}}\n"]
    if text := comments(PACKAGE):  # the file's own comment sits above its `package` line
        lines.append(text + "\n")
    for index, service in enumerate(file.service):
        lines.append(f"### `{service.name}` {{#{anchor(service.name)}}}\n")
        if text := comments(SERVICE, index):
            lines.append(text + "\n")
        lines.append("| method | request | response | what it does |\n|---|---|---|---|")
        for m_index, method in enumerate(service.method):
            request = ("stream " if method.client_streaming else "") + method.input_type.rsplit(".", 1)[-1]
            response = ("stream " if method.server_streaming else "") + method.output_type.rsplit(".", 1)[-1]
            lines.append(f"| `{method.name}` | [`{request}`](#{anchor(request.split()[-1])}) | "
                         f"[`{response}`](#{anchor(response.split()[-1])}) | {comments(SERVICE, index, METHOD, m_index)} |")
        lines.append("")
    if file.message_type or file.enum_type:
        lines.append("### Messages\n")
    for index, message in enumerate(file.message_type):
        lines += render_message(message, comments, (MESSAGE, index))
    for index, enum in enumerate(file.enum_type):
        lines += render_enum(enum, comments, (ENUM, index))
    return "\n".join(lines)


def proto_reference() -> str:
    """The Markdown of every sciproto contract file."""
    ours = [file for file in compile_protos().file if file.name.startswith("sciproto/")]
    ours.sort(key=lambda file: not file.service)  # the services first, then the shared types
    return "\n".join(render_file(file) for file in ours)


def implementers_guide() -> str:
    """proto/README.md, with its first heading left to the page that includes it."""
    text = (PROTO_ROOT / "README.md").read_text()
    return re.sub(r"\A# [^\n]*\n", "", text)
