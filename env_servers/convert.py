"""Conversions between the wire types (ChatMessage, ToolCall, ToolSpec) and Aviary's.

Actions are built explicitly: an assistant message with tool calls becomes a
`ToolRequestMessage`, anything else a plain `Message`. (Validating a plain assistant reply through
Aviary's message union would turn it into a `ToolRequestMessage` without calls, which GSM8K
scores as a failed tool call.)

A tool call the environment cannot run as written (unknown tool, arguments that are not a JSON
object, arguments that do not match the tool's parameters) is renamed to Aviary's
`INVALID_TOOL_NAME`, Aviary's marker for such calls, so that the environment answers it the way it
answers any invalid call instead of raising; `explain_invalid_calls` then makes sure the agent
reads why.
"""

from __future__ import annotations

import base64
import binascii
import json
import mimetypes
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aviary.core import Message, Tool, ToolCall, ToolRequestMessage, ToolResponseMessage
from aviary.tools.base import INVALID_TOOL_NAME, FunctionInfo, ToolCallFunction

from sciproto.errors import InvalidArgument, Reason
from sciproto.pb import common_pb2

_ROLE_FROM_AVIARY = {
    "system": common_pb2.ROLE_SYSTEM,
    "user": common_pb2.ROLE_USER,
    "assistant": common_pb2.ROLE_ASSISTANT,
    "tool": common_pb2.ROLE_TOOL,
    "function": common_pb2.ROLE_TOOL,
}
_ROLE_TO_AVIARY = {
    common_pb2.ROLE_SYSTEM: "system",
    common_pb2.ROLE_USER: "user",
    common_pb2.ROLE_ASSISTANT: "assistant",
    common_pb2.ROLE_TOOL: "tool",
}


# ---------------------------------------------------------------- Aviary -> wire


def message_to_proto(message: Message) -> common_pb2.ChatMessage:
    """One Aviary message as a ChatMessage; None content becomes empty text."""
    text, parts = _content(message)
    proto = common_pb2.ChatMessage(
        role=_ROLE_FROM_AVIARY.get(message.role, common_pb2.ROLE_USER), content=text, parts=parts
    )
    if isinstance(message, ToolRequestMessage):
        for call in message.tool_calls:
            proto.tool_calls.add(
                id=call.id, name=call.function.name, arguments=json.dumps(call.function.arguments)
            )
    elif isinstance(message, ToolResponseMessage):
        proto.tool_call_id = message.tool_call_id
        proto.name = message.name
    return proto


def _content(message: Message) -> tuple[str, list[common_pb2.ContentPart]]:
    """The message's text, and its typed parts when it has more than text. Aviary's multimodal
    content (a JSON list of OpenAI-style parts; the notebook sends a figure that way) becomes
    text and image parts, the text parts joined into `content`; content made only of text
    parts is plain text, without parts."""
    if not message.content_is_json_str or not message.content:
        return message.content or "", []
    try:
        items = json.loads(message.content)
    except json.JSONDecodeError:
        return message.content, []
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        return message.content, []
    parts = [_part(item) for item in items]
    text = "\n".join(part.text for part in parts if part.WhichOneof("part") == "text")
    if all(part.WhichOneof("part") == "text" for part in parts):
        return text, []
    return text, parts


def _part(item: dict[str, Any]) -> common_pb2.ContentPart:
    """One OpenAI-style content part: text, an image_url (a data: URL becomes the image's bytes,
    any other URL a file reference), or anything else kept as its JSON text."""
    if item.get("type") == "text":
        return common_pb2.ContentPart(text=str(item.get("text", "")))
    url = item.get("image_url", {}).get("url", "") if isinstance(item.get("image_url"), dict) else ""
    if item.get("type") == "image_url" and url.startswith("data:") and ";base64," in url:
        header, encoded = url.split(",", 1)
        mime_type = header.removeprefix("data:").split(";", 1)[0] or "application/octet-stream"
        try:
            data = base64.b64decode(encoded, validate=True)
        except binascii.Error:
            return common_pb2.ContentPart(text=json.dumps(item))
        return common_pb2.ContentPart(image=common_pb2.ImagePart(data=data, mime_type=mime_type))
    if item.get("type") == "image_url" and url:
        return common_pb2.ContentPart(file=common_pb2.FileRef(uri=url, mime_type=mimetypes.guess_type(url)[0] or ""))
    return common_pb2.ContentPart(text=json.dumps(item))


def messages_to_proto(messages: Sequence[Message]) -> list[common_pb2.ChatMessage]:
    return [message_to_proto(message) for message in messages]


# id(FunctionInfo) -> (a weak reference to it, its ToolSpec), for tools that share one FunctionInfo
# across episodes (see env_servers.envs.source.cached_tool). An entry goes when its FunctionInfo
# does, so environments that build fresh tools on every reset leave nothing behind.
_SPECS: dict[int, tuple[weakref.ref[FunctionInfo], common_pb2.ToolSpec]] = {}


def tool_to_proto(tool: Tool) -> common_pb2.ToolSpec:
    """A Tool in OpenAI function form, its parameters' JSON Schema as text. The spec of a
    FunctionInfo seen before is the one made then (do not modify what this returns)."""
    info, key = tool.info, id(tool.info)
    cached = _SPECS.get(key)
    if cached is not None and cached[0]() is info:
        return cached[1]
    spec = _spec(info)
    _SPECS[key] = (weakref.ref(info, lambda _, key=key: _SPECS.pop(key, None)), spec)
    return spec


def _spec(info: FunctionInfo) -> common_pb2.ToolSpec:
    parameters = info.parameters
    schema = (
        parameters.model_dump(exclude_none=True, by_alias=True)
        if parameters is not None
        else {"type": "object", "properties": {}}
    )
    return common_pb2.ToolSpec(
        name=info.name,
        description=info.description,
        parameters_json_schema=json.dumps(schema),
    )


def tools_to_proto(tools: Sequence[Tool]) -> list[common_pb2.ToolSpec]:
    return [tool_to_proto(tool) for tool in tools]


# ---------------------------------------------------------------- wire -> Aviary


@dataclass
class Action:
    """An agent action ready for `env.step`, and why any of its tool calls is invalid."""

    message: Message
    invalid_calls: dict[str, str] = field(default_factory=dict)  # ToolCall.id -> reason


def _role_name(role: int) -> str:
    """The enum name of `role`, or its number when it is none of Role's (open enums take any int)."""
    return common_pb2.Role.Name(role) if role in common_pb2.Role.values() else str(role)


def action_from_proto(action: common_pb2.ChatMessage, tools: Sequence[Tool]) -> Action:
    """The Aviary action for an assistant ChatMessage, checked against the episode's tools.

    Raises InvalidArgument for a message that is not an action at all (wrong role, tool calls
    without distinct ids); a call the agent got wrong is kept, marked invalid, for the
    environment to answer.
    """
    if action.role != common_pb2.ROLE_ASSISTANT:
        raise InvalidArgument(
            f"action.role is {_role_name(action.role)}; an action must be an assistant"
            " message (ROLE_ASSISTANT) with tool calls or content",
            Reason.INVALID_ACTION,
        )
    if not action.tool_calls:
        return Action(Message(role="assistant", content=action.content))
    ids = [call.id for call in action.tool_calls]
    if "" in ids or len(set(ids)) != len(ids):
        raise InvalidArgument(
            f"action.tool_calls ids {ids} must be non-empty and distinct: the environment's tool"
            " messages answer each call by its id",
            Reason.INVALID_ACTION,
        )
    by_name = {tool.info.name: tool for tool in tools}
    calls, invalid = [], {}
    for call in action.tool_calls:
        arguments, problem = _checked_arguments(call, by_name)
        if problem is not None:
            invalid[call.id] = problem
        name = INVALID_TOOL_NAME if problem is not None else call.name
        calls.append(ToolCall(id=call.id, function=ToolCallFunction(name=name, arguments=arguments)))
    message = ToolRequestMessage(content=action.content or None, tool_calls=calls)
    return Action(message, invalid)


def _checked_arguments(
    call: common_pb2.ToolCall, tools: Mapping[str, Tool]
) -> tuple[dict[str, object], str | None]:
    """The call's arguments as a dict, and what is wrong with the call (None if nothing)."""
    tool = tools.get(call.name)
    if tool is None:
        return {}, f"there is no tool {call.name!r}; the tools are {sorted(tools)}"
    try:
        arguments = json.loads(call.arguments) if call.arguments.strip() else {}
    except json.JSONDecodeError as error:
        return {}, f"the arguments of {call.name!r} are not valid JSON ({error}): {call.arguments!r}"
    if not isinstance(arguments, dict):
        return {}, f"the arguments of {call.name!r} must be a JSON object, got {call.arguments!r}"
    parameters = tool.info.parameters
    expected = set(parameters.properties) if parameters is not None else set()
    required = set(parameters.required or []) if parameters is not None else set()
    unknown, missing = arguments.keys() - expected, required - arguments.keys()
    if unknown or missing:
        return {}, (
            f"{call.name!r} takes arguments {sorted(expected)} (required: {sorted(required)});"
            f" unknown {sorted(unknown)}, missing {sorted(missing)}"
        )
    for name, value in arguments.items():
        problem = _shape_problem(call.name, name, value, parameters.properties[name])  # type: ignore[union-attr]
        if problem is not None:
            return {}, problem
    return arguments, None


_SCALAR_TYPES = {"string", "number", "integer", "boolean"}


def _shape_problem(tool: str, name: str, value: object, schema: Mapping[str, object]) -> str | None:
    """Why `value` cannot stand for a scalar parameter: null, an object or a list where the schema
    wants a string, number or boolean (a tool would raise on it, failing the episode as if the
    environment broke). Numbers for strings and the reverse pass: LLMs mix them and tools cope."""
    declared = schema.get("type")
    types = {declared} if isinstance(declared, str) else set(declared) if isinstance(declared, list) else set()
    if not types or not types <= _SCALAR_TYPES or not (value is None or isinstance(value, dict | list)):
        return None
    return f"argument {name!r} of {tool!r} must be a {' or '.join(sorted(types))}, got {json.dumps(value)}"


def explain_invalid_calls(observations: list[Message], invalid_calls: Mapping[str, str]) -> None:
    """Put the reason into the tool message answering each invalid call, where the environment
    left it empty (GSM8K's CalculatorEnv answers invalid calls with empty text)."""
    if not invalid_calls:
        return
    for message in observations:
        answers_invalid = isinstance(message, ToolResponseMessage) and message.tool_call_id in invalid_calls
        if answers_invalid and not message.content:
            message.content = f"Invalid tool call: {invalid_calls[message.tool_call_id]}"


def message_from_proto(message: common_pb2.ChatMessage) -> Message:
    """A recorded ChatMessage as an Aviary message, for re-scoring a stored trajectory.
    Tool calls are kept as recorded (arguments that are not a JSON object become {})."""
    role = _ROLE_TO_AVIARY.get(message.role)
    if role is None:
        raise InvalidArgument(
            "a trajectory message has role ROLE_UNSPECIFIED; set each message's role",
            Reason.INVALID_REQUEST,
        )
    if role == "assistant" and message.tool_calls:
        calls = []
        for call in message.tool_calls:
            try:
                arguments = json.loads(call.arguments) if call.arguments.strip() else {}
            except json.JSONDecodeError:
                arguments = {}
            calls.append(ToolCall(id=call.id or ToolCall.generate_id(), function=ToolCallFunction(
                name=call.name, arguments=arguments if isinstance(arguments, dict) else {})))
        return ToolRequestMessage(content=message.content or None, tool_calls=calls)
    if role == "tool":
        return ToolResponseMessage(content=message.content, name=message.name or "tool",
                                   tool_call_id=message.tool_call_id)
    return Message(role=role, content=message.content)
