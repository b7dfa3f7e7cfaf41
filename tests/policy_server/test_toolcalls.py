import json

from policy_server.toolcalls import parse_completion, render_tool_call
from sciproto.models.byte_tokenizer import build_byte_tokenizer


def test_parses_calls_and_keeps_surrounding_text():
    text = (
        "Let me compute.\n"
        '<tool_call>\n{"name": "calculator", "arguments": {"expr": "2+2"}}\n</tool_call>\n'
        '<tool_call>{"name": "submit", "arguments": "{\\"answer\\": 4}"}</tool_call>'
    )
    parsed = parse_completion(text)
    assert not parsed.malformed
    assert [call.name for call in parsed.tool_calls] == ["calculator", "submit"]
    assert json.loads(parsed.tool_calls[0].arguments) == {"expr": "2+2"}
    assert json.loads(parsed.tool_calls[1].arguments) == {"answer": 4}
    assert parsed.content == "Let me compute."
    assert len({call.id for call in parsed.tool_calls}) == 2


def test_malformed_calls_come_back_as_text():
    for bad in [
        '<tool_call>{"name": "f", "arguments": {</tool_call>',  # broken JSON
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        'ok <tool_call>{"name": "f", "arguments": {}}',  # never closed
    ]:
        parsed = parse_completion(bad)
        assert parsed.malformed, bad
        assert parsed.tool_calls == []
        assert "<tool_call>" in parsed.content


def test_good_call_next_to_malformed_one_is_kept():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>nope</tool_call>'
    parsed = parse_completion(text)
    assert parsed.malformed
    assert [call.name for call in parsed.tool_calls] == ["a"]
    assert parsed.content == "<tool_call>nope</tool_call>"


def test_plain_text_has_no_calls():
    parsed = parse_completion("The answer is 4.")
    assert parsed == parse_completion("The answer is 4.")
    assert parsed.tool_calls == [] and not parsed.malformed and parsed.content == "The answer is 4."


def test_chat_template_writes_calls_as_render_tool_call_does_and_they_parse_back():
    tokenizer = build_byte_tokenizer()
    arguments = json.dumps({"expr": "6*7", "note": "é"}, ensure_ascii=False)
    message = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": arguments}}
        ],
    }
    rendered = tokenizer.apply_chat_template([message], tokenize=False)
    assert render_tool_call("calc", arguments) in rendered
    parsed = parse_completion(
        rendered.removeprefix("<|im_start|>assistant\n").removesuffix("<|im_end|>\n")
    )
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("calc", {"expr": "6*7", "note": "é"})
    ]
