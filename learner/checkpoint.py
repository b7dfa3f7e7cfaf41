"""Checkpoints of a GRPOTrainer: resuming gives exactly the step an uninterrupted run would take.

Layout: <run_dir>/checkpoints/step_<step:08d>/ (sciproto.rundir names every file)
    model.safetensors   full weights, named as in the model's state dict
    trainer_state.pt    optimizer state, step, policy version, RNG states
    manifest.json       step, policy version, config, file names (readable without torch)
With a LoRA adapter (learner/lora.py) model.safetensors holds the adapter's fp32 tensors alone,
named as PEFT saves them, and trainer_state.pt its AdamW state alone; the manifest's "lora" names
the adapter's spec and its base (model name and XXH3 set digest of the base weights), and a
resume into another spec or base is refused.
A checkpoint is written to a temporary folder and renamed into place, so a crash mid-save never
leaves a half checkpoint; the learner service then adds its learner_state.json, and only then is
the checkpoint complete (`sciproto.rundir.latest_checkpoint`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from learner.distributed import current_context, full_state_dict
from learner.trainer import GRPOTrainer
from sciproto.config import ConfigError
from sciproto.rundir import (
    MANIFEST_FILE,
    WEIGHTS_FILE,
    checkpoint_dir,
    checkpoints_dir,
    latest_checkpoint,
    staging_dir,
)
from sciproto.rundir import TRAINER_STATE_FILE as STATE_FILE

FORMAT_VERSION = 1


def _untied(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied embeddings): copy the aliases."""
    seen: set[int] = set()
    result = {}
    for name, tensor in weights.items():
        pointer = tensor.untyped_storage().data_ptr()
        result[name] = tensor.clone() if pointer in seen else tensor.contiguous()
        seen.add(pointer)
    return result


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(trainer: GRPOTrainer, run_dir: str | Path) -> Path:
    """Save on rank 0 (collective under FSDP2: every rank must call it); returns the folder."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = full_state_dict(trainer.model) if trainer.lora is None else trainer.lora.state_dict(torch.float32)
    optimizer_state = get_optimizer_state_dict(trainer.model, trainer.optimizer, options=options)
    final = checkpoint_dir(run_dir, trainer.step)
    if current_context().is_main:
        staging = staging_dir(final)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        save_file(_untied(weights), str(staging / WEIGHTS_FILE))
        torch.save(
            {
                "format_version": FORMAT_VERSION,
                "optimizer": optimizer_state,
                "step": trainer.step,
                "policy_version": trainer.policy_version,
                "rng": _rng_state(),
            },
            staging / STATE_FILE,
        )
        manifest = {
            "format_version": FORMAT_VERSION,
            "step": trainer.step,
            "policy_version": trainer.policy_version,
            "saved_at_unix": time.time(),
            "config": trainer.config.model_dump(mode="json"),
            "lora": None if trainer.lora is None else trainer.lora.identity(),
            "files": {"weights": WEIGHTS_FILE, "state": STATE_FILE},
        }
        (staging / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
    return final


def load_checkpoint(trainer: GRPOTrainer, path: str | Path) -> None:
    """Restore weights, optimizer, step, policy version and RNG into a freshly built trainer.

    Collective under FSDP2: every rank must call it and every rank reads the folder.
    """
    path = Path(path)
    if not (path / MANIFEST_FILE).is_file():
        raise FileNotFoundError(
            f"{path} is not a checkpoint (no {MANIFEST_FILE}); pass a folder from "
            f"latest_checkpoint(run_dir)"
        )
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    if state.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path} has checkpoint format {state.get('format_version')}, this learner reads "
            f"format {FORMAT_VERSION}"
        )
    saved_lora = json.loads((path / MANIFEST_FILE).read_text()).get("lora")
    options = StateDictOptions(full_state_dict=True)
    if trainer.lora is not None:
        trainer.lora.check_identity(saved_lora, f"checkpoint {path}")
        trainer.lora.load_state_dict(load_file(str(path / WEIGHTS_FILE)))
    elif saved_lora is not None:
        raise ConfigError(f"checkpoint {path} holds LoRA adapter {saved_lora['spec']['name']!r}, not full weights; "
                          "resume it with learner.lora set as it was, or use another run_dir")
    else:
        set_model_state_dict(trainer.model, load_file(str(path / WEIGHTS_FILE)), options=options)
    set_optimizer_state_dict(trainer.model, trainer.optimizer, state["optimizer"], options=options)
    trainer.step = state["step"]
    trainer.policy_version = state["policy_version"]
    _restore_rng(state["rng"])



__all__ = ["FORMAT_VERSION", "MANIFEST_FILE", "STATE_FILE", "WEIGHTS_FILE", "checkpoints_dir", "latest_checkpoint",
           "load_checkpoint", "save_checkpoint"]
