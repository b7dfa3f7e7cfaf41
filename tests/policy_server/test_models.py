import torch
from gguf import GGUFReader

from policy_server.types import ChatMessage, ToolCall
from sciproto.models import load_model
from sciproto.models.byte_tokenizer import SPECIAL_TOKENS, build_byte_tokenizer
from sciproto.models.smollm2 import smollm2_gguf_path
from sciproto.prompts import render_chat

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "evaluate",
            "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}},
        },
    }
]


def test_byte_tokenizer_round_trips_and_keeps_special_tokens_whole():
    tokenizer = build_byte_tokenizer()
    text = "héllo\n<|im_start|>user<tool_call></tool_call>\x00"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert ids[:3] == [ord("h"), 0xC3, 0xA9]  # one token per UTF-8 byte, id == byte value
    assert [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(256, 262))
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") in ids


def test_chat_template_renders_every_role_tools_and_generation_prompt():
    tokenizer = build_byte_tokenizer()
    messages = [
        ChatMessage("system", "Be brief."),
        ChatMessage("user", "6*7?"),
        ChatMessage("assistant", "", [ToolCall("c1", "calc", '{"expr": "6*7"}')]),
        ChatMessage("tool", "42", tool_call_id="c1"),
    ]
    text = render_chat(tokenizer, messages, TOOLS, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert '"name": "calc"' in text.split("\n</tools>")[0]
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "calc", "arguments": {"expr": "6*7"}}\n</tool_call><|im_end|>\n'
        in text
    )
    assert "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert not render_chat(tokenizer, messages[1:2], [], False).startswith("<|im_start|>system")


def test_tiny_model_is_seeded():
    a, b, c = load_model("tiny", seed=3), load_model("tiny", seed=3), load_model("tiny", seed=4)
    first = next(a.model.parameters())
    assert torch.equal(first, next(b.model.parameters()))
    assert not torch.equal(first, next(c.model.parameters()))
    assert a.stop_token_ids == {
        a.tokenizer.convert_tokens_to_ids("<|im_end|>"),
        a.tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    }


def test_smollm2_loads_offline_and_its_template_matches_the_original(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded = load_model("smollm2", dtype=torch.bfloat16)
    assert loaded.model.config.num_hidden_layers == 30 and loaded.max_context == 8192
    assert loaded.model.dtype == torch.bfloat16
    field = GGUFReader(smollm2_gguf_path()).fields["tokenizer.chat_template"]
    original_template = bytes(field.parts[field.data[0]]).decode()
    conversation = [
        ChatMessage("user", "What is 2+2?"),
        ChatMessage("assistant", "4"),
        ChatMessage("user", "And 3+3?"),
    ]
    ours = render_chat(loaded.tokenizer, conversation, [], add_generation_prompt=True)
    theirs = loaded.tokenizer.apply_chat_template(
        [m.to_template_dict() for m in conversation],
        chat_template=original_template,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert ours == theirs
    with_tools = render_chat(loaded.tokenizer, conversation, TOOLS, add_generation_prompt=True)
    assert "You are a helpful AI assistant named SmolLM" in with_tools and "<tools>" in with_tools
    assert loaded.tokenizer.convert_tokens_to_ids("<|im_end|>") in loaded.stop_token_ids


def test_smollm2_is_a_plain_model_the_learner_can_train_in_fp32(monkeypatch):
    """The GGUF file is dequantized on load: nothing quantized is left, so the learner's fp32
    master-weight cast (`learner.precision.prepare_model`) and any `.float()` work."""
    from learner.precision import prepare_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = load_model("smollm2", dtype=torch.bfloat16).model
    assert not getattr(model, "is_quantized", False)
    trained = prepare_model(model, "fp32")
    assert {p.dtype for p in trained.parameters()} == {torch.float32}
