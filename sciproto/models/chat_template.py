"""A ChatML chat template with Hermes/Qwen-style tools, for tokenizers that lack one.

Layout of a rendered conversation:

    <|im_start|>system\n{system text}[\n\n# Tools ... <tools>{schemas}</tools> ...]<|im_end|>\n
    <|im_start|>user\n{text}<|im_end|>\n
    <|im_start|>assistant\n{text}[\n<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>]<|im_end|>\n
    <|im_start|>user\n<tool_response>\n{tool output}\n</tool_response><|im_end|>\n   (consecutive tool messages share one turn)
    [<|im_start|>assistant\n]   (add_generation_prompt)

Tool calls are written exactly as `policy_server.toolcalls.render_tool_call` writes them.
"""

from __future__ import annotations

import json

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)

_TEMPLATE = """
{%- set default_system = DEFAULT_SYSTEM -%}
{%- if messages[0].role == 'system' -%}
  {%- set system_text = messages[0].content -%}
  {%- set rest = messages[1:] -%}
{%- else -%}
  {%- set system_text = default_system -%}
  {%- set rest = messages -%}
{%- endif -%}
{%- if system_text is not none or tools -%}
{{ '<|im_start|>system\n' + (system_text or '') }}
  {%- if tools -%}
{{ ('\n\n' if system_text else '') + TOOLS_PREAMBLE }}
    {%- for tool in tools -%}{{ '\n' + (tool | tojson) }}{%- endfor -%}
{{ TOOLS_POSTAMBLE }}
  {%- endif -%}
{{ '<|im_end|>\n' }}
{%- endif -%}
{%- for message in rest -%}
  {%- if message.role == 'tool' -%}
    {%- if loop.first or loop.previtem.role != 'tool' -%}{{ '<|im_start|>user' }}{%- endif -%}
    {{ '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
    {%- if loop.last or loop.nextitem.role != 'tool' -%}{{ '<|im_end|>\\n' }}{%- endif -%}
  {%- else -%}
    {{ '<|im_start|>' + message.role + '\\n' + (message.content or '') }}
    {%- for call in message.tool_calls or [] -%}
      {%- set function = call.function if call.function is defined else call -%}
      {%- if message.content or not loop.first -%}{{ '\\n' }}{%- endif -%}
      {{ '<tool_call>\\n{"name": ' + (function.name | tojson) + ', "arguments": ' }}
      {%- if function.arguments is string -%}{{ function.arguments }}{%- else -%}{{ function.arguments | tojson }}{%- endif -%}
      {{ '}\\n</tool_call>' }}
    {%- endfor -%}
    {{ '<|im_end|>\\n' }}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}
"""


def chatml_tool_template(default_system: str | None = None) -> str:
    """The template text; `default_system` is the system text used when the conversation has no
    system message (None: no system turn unless tools are given)."""
    return (
        _TEMPLATE.replace(
            "DEFAULT_SYSTEM", json.dumps(default_system) if default_system else "none"
        )
        .replace("TOOLS_PREAMBLE", json.dumps(TOOLS_PREAMBLE))
        .replace("TOOLS_POSTAMBLE", json.dumps(TOOLS_POSTAMBLE))
        .strip()
    )
