"""Hermes/Qwen tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.

`parse_completion` turns completion text into tool calls; `render_tool_call` is the inverse, and
the chat template in `sciproto.models.chat_template` writes the same text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from policy_server.types import ToolCall

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

# A closed block, or an opened one the completion never closed (cut off by max_tokens).
_BLOCK = re.compile(
    re.escape(TOOL_CALL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CALL_CLOSE) + r"|\Z)", re.DOTALL
)


@dataclass(frozen=True)
class ParsedCompletion:
    """`content` is the text outside well-formed tool-call blocks; a malformed block stays in
    `content` verbatim and sets `malformed`."""

    content: str
    tool_calls: list[ToolCall]
    malformed: bool


def render_tool_call(name: str, arguments: str) -> str:
    """The text of one call; `arguments` is a JSON object as a string, written verbatim."""
    return f'{TOOL_CALL_OPEN}\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n{TOOL_CALL_CLOSE}'


def parse_completion(text: str) -> ParsedCompletion:
    tool_calls: list[ToolCall] = []
    content_parts: list[str] = []
    malformed = False
    position = 0
    for match in _BLOCK.finditer(text):
        content_parts.append(text[position : match.start()])
        position = match.end()
        closed = match.group(0).endswith(TOOL_CALL_CLOSE)
        call = _parse_call_body(match.group(1)) if closed else None
        if call is None:
            malformed = True
            content_parts.append(match.group(0))
        else:
            tool_calls.append(call)
    content_parts.append(text[position:])
    return ParsedCompletion("".join(content_parts).strip(), tool_calls, malformed)


def _parse_call_body(body: str) -> ToolCall | None:
    """The call in one block, or None when it is not {"name": str, "arguments": object}."""
    try:
        payload = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return None
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments object as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(
        id=f"call_{uuid.uuid4().hex[:24]}",
        name=payload["name"],
        arguments=json.dumps(arguments, ensure_ascii=False),
    )
