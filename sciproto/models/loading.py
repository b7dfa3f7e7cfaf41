"""`load_model(spec)`: one entry point for every model the policy server can serve;
`model_directory(spec)`: the same model as a Hugging Face directory, for engines that load one
(vLLM)."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from sciproto.models.byte_tokenizer import build_byte_tokenizer
from sciproto.models.chat_template import chatml_tool_template
from sciproto.models.smollm2 import load_smollm2_model, load_smollm2_tokenizer
from sciproto.models.tiny import TINY_MAX_CONTEXT, build_tiny_model

MODEL_SPECS_HELP = '"tiny", "smollm2", or the path of a local Hugging Face model directory'


@dataclass
class LoadedModel:
    model: PreTrainedModel  # in eval mode, gradients off
    tokenizer: PreTrainedTokenizerBase  # with a chat template and a pad token
    name: str
    max_context: int  # prompt + completion tokens the model can attend over
    stop_token_ids: frozenset[int]  # sampling one of these ends a sample


def load_model(
    spec: str, dtype: torch.dtype = torch.float32, seed: int = 0, device: str = "cpu"
) -> LoadedModel:
    """Load `spec` (see MODEL_SPECS_HELP) offline; `seed` only matters for "tiny"."""
    if spec == "tiny":
        model, tokenizer = build_tiny_model(seed, dtype), build_byte_tokenizer()
        name, max_context = f"tiny-qwen2-seed{seed}", TINY_MAX_CONTEXT
    elif spec == "smollm2":
        model, tokenizer = load_smollm2_model(dtype), load_smollm2_tokenizer()
        name, max_context = "SmolLM2-135M-Instruct", model.config.max_position_embeddings
    elif Path(spec).is_dir():
        model, tokenizer = _load_local_directory(Path(spec), dtype)
        name, max_context = Path(spec).name, model.config.max_position_embeddings
    else:
        raise ValueError(f"unknown model {spec!r}: expected {MODEL_SPECS_HELP}")
    model.to(device).eval().requires_grad_(False)
    return LoadedModel(model, tokenizer, name, max_context, _stop_token_ids(model, tokenizer))


def model_directory(spec: str, seed: int = 0, cache: Path | None = None) -> Path:
    """`spec` as a Hugging Face model directory: a directory as given, or "tiny" / "smollm2"
    saved once (fp32 safetensors, tokenizer with its chat template) under `cache` (default
    `$SCIPROTO_CACHE`, else `~/.cache/sciproto`) and reused from then on. The directory appears
    whole or not at all: it is written beside its final name and renamed into place."""
    if Path(spec).is_dir():
        return Path(spec)
    if spec not in ("tiny", "smollm2"):
        raise ValueError(f"unknown model {spec!r}: expected {MODEL_SPECS_HELP}")
    root = cache or Path(os.environ.get("SCIPROTO_CACHE") or Path.home() / ".cache" / "sciproto")
    target = root / "models" / (f"tiny-qwen2-seed{seed}" if spec == "tiny" else "SmolLM2-135M-Instruct")
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    loaded = load_model(spec, seed=seed)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        loaded.model.save_pretrained(staging)
        loaded.tokenizer.chat_template = loaded.tokenizer.chat_template or chatml_tool_template()
        loaded.tokenizer.save_pretrained(staging)
        try:
            staging.rename(target)
        except OSError:  # another process saved it first: theirs is the same model
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _load_local_directory(
    path: Path, dtype: torch.dtype
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, padding_side="left")
    if tokenizer.chat_template is None:
        tokenizer.chat_template = chatml_tool_template()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # only ever used under a zero attention mask
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    return model, tokenizer


def _stop_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The model's end-of-sequence ids plus the tokenizer's: chat models end a turn with one and
    end a document with the other."""
    ids: set[int] = set()
    for source in (
        model.generation_config.eos_token_id,
        model.config.eos_token_id,
        tokenizer.eos_token_id,
    ):
        if isinstance(source, int):
            ids.add(source)
        elif source is not None:
            ids.update(source)
    if not ids:
        raise ValueError(
            "the model and tokenizer name no end-of-sequence token; cannot stop samples"
        )
    return frozenset(ids)
