"""Chat requests as a policy takes them: messages, tool calls and the GenerationRequest a policy
backend samples from, and the protobuf ChatMessage and ToolSpec read into them (a request the
caller must fix raises InvalidArgument, naming the field). The policy server and the clients that
make prompt tokens as it does (`sciproto.prompts`) share these.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field

from sciproto.errors import InvalidArgument, Reason, Unimplemented
from sciproto.pb import common_pb2
from sciproto.sampling import Sampling


@dataclass(frozen=True)
class ToolCall:
    """One function call the model asked for; `arguments` is a JSON object as a string."""

    id: str
    name: str
    arguments: str


@dataclass
class ChatMessage:
    """An OpenAI-style chat message. Assistant messages may carry tool calls; tool messages
    answer one call by `tool_call_id`."""

    role: str
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ("system", "user", "assistant", "tool"):
            raise ValueError(
                f"message role {self.role!r} is not one of system, user, assistant, tool"
            )

    def to_template_dict(self) -> dict[str, Any]:
        """The dict shape chat templates expect (OpenAI chat format)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class SamplingParams(Sampling):
    """How to sample (sciproto.sampling.Sampling: temperature 0 is greedy; seed None draws fresh
    entropy per request), and how many samples of the prompt to draw."""

    n: int = Field(1, ge=1, description="Samples drawn from the same prompt (a GRPO group)")


@dataclass
class GenerationRequest:
    """Either chat `messages` (+ `tools`, OpenAI function schemas) or raw `prompt_token_ids`.

    For a later turn of a chat, `previous_token_ids` holds the exact prompt + completion ids of the
    previous turn; the new prompt is those ids followed by the tokens of what the conversation
    added since, so earlier ids are never re-tokenized.
    """

    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None
    previous_token_ids: list[int] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = ""
    adapter: str = ""  # the LoRA adapter to sample with (protocol 1.4); "": the base weights

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.prompt_token_ids is None):
            raise ValueError("give exactly one of messages or prompt_token_ids")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise ValueError("prompt_token_ids is empty")
        if self.prompt_token_ids is not None and (self.tools or self.previous_token_ids):
            raise ValueError("tools and previous_token_ids only apply to chat messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages is empty")


_ROLES = {
    common_pb2.ROLE_SYSTEM: "system",
    common_pb2.ROLE_USER: "user",
    common_pb2.ROLE_ASSISTANT: "assistant",
    common_pb2.ROLE_TOOL: "tool",
}


def invalid_request(message: str) -> InvalidArgument:
    """INVALID_ARGUMENT (reason INVALID_REQUEST) with a message saying what to fix."""
    return InvalidArgument(message, Reason.INVALID_REQUEST)


def chat_message(message: common_pb2.ChatMessage, index: int) -> ChatMessage:
    role = _ROLES.get(message.role)
    if role is None:
        raise invalid_request(f"chat.messages[{index}].role is unset; set it to ROLE_SYSTEM, ROLE_USER, "
                       "ROLE_ASSISTANT or ROLE_TOOL")
    empty = next((number for number, part in enumerate(message.parts) if part.WhichOneof("part") is None), None)
    if empty is not None:
        raise invalid_request(f"chat.messages[{index}].parts[{empty}] is empty; set its text, image or file")
    kinds = {str(part.WhichOneof("part")) for part in message.parts} - {"text"}
    if kinds:
        # Every backend here serves a text-only model; a part it cannot see is refused, never dropped.
        raise Unimplemented(
            f"chat.messages[{index}] has {' and '.join(sorted(kinds))} parts, and this server's model takes"
            " text only: send the message's text (ChatMessage.content) without its parts, or use a policy"
            " server whose Describe lists the content.image capability", Reason.UNSUPPORTED,
            metadata={"message_index": str(index), "part_kinds": ",".join(sorted(kinds))})
    text = message.content or "\n".join(part.text for part in message.parts)
    return ChatMessage(
        role=role,
        content=text,
        tool_calls=[ToolCall(call.id, call.name, call.arguments) for call in message.tool_calls],
        tool_call_id=message.tool_call_id or None,
        name=message.name or None,
    )


def tool_spec(tool: common_pb2.ToolSpec, index: int) -> dict[str, Any]:
    """The OpenAI function-tool dict of a ToolSpec."""
    if not tool.name:
        raise invalid_request(f"chat.tools[{index}].name is empty; give the function name")
    try:
        parameters = json.loads(tool.parameters_json_schema) if tool.parameters_json_schema else {"type": "object"}
    except json.JSONDecodeError as error:
        raise invalid_request(f"chat.tools[{index}] ({tool.name}): parameters_json_schema is not JSON: {error}") from error
    if not isinstance(parameters, dict):
        raise invalid_request(f"chat.tools[{index}] ({tool.name}): parameters_json_schema must be a JSON object")
    function = {"name": tool.name, "description": tool.description, "parameters": parameters}
    return {"type": "function", "function": function}
