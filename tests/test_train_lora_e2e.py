"""Two `sciproto train` runs share one policy server (`policy.address`), each training its own LoRA
adapter (`learner.lora`): each learns the demo's toy task, the server ends holding both adapters at
their runs' last versions with the digests of their runs' checkpoints, its base weights untouched,
and the run that stops first leaves the other training; `sciproto eval` of a LoRA checkpoint samples
with its adapter. Real processes throughout."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import load_file

from sciproto.client.policy import PolicyClient
from sciproto.lora import LoraSpec, adapter_tensor_specs, linear_layers
from sciproto.models import load_model
from sciproto.processes import ServerProcess, start_server
from sciproto.weights.wire import set_digest, tensor_digests

# LoRA on every linear layer of the tiny model, at a learning rate for the adapter's few weights
# (the demo's 5e-3 is for full fine-tuning): 15 steps to the demo's target, as 17 do fully.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA = ["--set", "learner.lora.rank=8", "--set", f"learner.lora.target_modules=[{','.join(TARGETS)}]",
        "--set", "learner.grpo.lr=2e-2"]
SHORT_STEPS = 4  # the run that stops first


@pytest.fixture(scope="module")
def shared_policy() -> Iterator[ServerProcess]:
    """The demo's policy server, started outside either run."""
    server = start_server(["serve", "policy", "--port", "0", "--model", "tiny", "--set", "seed=0",
                           "--set", "transformers.batch_window_s=0.02"], timeout_s=300)
    try:
        yield server
    finally:
        server.stop()


def train(tmp_path: Path, name: str, policy: str, *extra: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "sciproto", "train", "--config", "demo", "--set", f"run.dir={tmp_path}",
               "--set", f"run.name={name}", "--set", "progress=false", "--set", f"policy.address={policy}",
               "--set", f"learner.lora.name={name}", *LORA, *extra]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})


def logs_of(run_dir: Path) -> str:
    """The end of each server log of a run, to say why it failed."""
    return "".join(f"\n--- {log.name}:\n{log.read_text(errors='replace')[-3000:]}" for log in sorted(run_dir.glob("*.log")))


def adapter_digest(run_dir: Path, name: str) -> bytes:
    """The set digest of the adapter in the run's last checkpoint, its tensors in the wire's order."""
    checkpoint = max((run_dir / "checkpoints").glob("step_*"))
    saved = load_file(str(checkpoint / "model.safetensors"))
    spec = LoraSpec(name=name, rank=8, target_modules=TARGETS)
    order = [t.name for t in adapter_tensor_specs(linear_layers(load_model("tiny").model), spec, "float32")]
    return set_digest(tensor_digests({tensor: saved[tensor] for tensor in order}))


async def describe(target: str):
    async with PolicyClient(target) as client:
        return await client.describe(timeout_s=30)


@pytest.mark.slow
@pytest.mark.timeout(1100)
def test_two_runs_train_their_own_adapters_on_one_policy_server(tmp_path: Path, shared_policy: ServerProcess
                                                                 ) -> None:
    long = train(tmp_path, "team-a", shared_policy.target, "--set", "budget.max_seconds=600")
    short = train(tmp_path, "team-b", shared_policy.target, "--set", f"budget.max_steps={SHORT_STEPS}",
                  "--set", "budget.target_reward=null")
    try:
        short_output, _ = short.communicate(timeout=600)
        metrics = tmp_path / "team-a" / "metrics.jsonl"
        long_steps_then = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        assert short.returncode == 0, short_output[-4000:] + logs_of(tmp_path / "team-b")
        assert long.poll() is None, "the longer run ended with the shorter one"
        long_output, _ = long.communicate(timeout=720)
    finally:
        for process in (long, short):
            if process.poll() is None:
                process.terminate()
                process.communicate(timeout=180)
    assert long.returncode == 0, long_output[-4000:] + logs_of(tmp_path / "team-a")
    long_dir, short_dir = tmp_path / "team-a", tmp_path / "team-b"
    long_summary = json.loads((long_dir / "summary.json").read_text())
    assert long_summary["stopped_by"] == "target_reward", long_output[-3000:]
    long_steps = [json.loads(line) for line in (long_dir / "metrics.jsonl").read_text().splitlines()]
    short_steps = [json.loads(line) for line in (short_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(short_steps) == SHORT_STEPS
    assert len(long_steps) > long_steps_then, "the longer run trained no step after the shorter one stopped"

    served = asyncio.run(describe(shared_policy.target))
    adapters = {a.adapter.name: a for a in served.adapters}
    assert set(adapters) == {"team-a", "team-b"}
    for name, steps, run_dir in (("team-a", long_steps, long_dir), ("team-b", short_steps, short_dir)):
        assert adapters[name].policy_version == steps[-1]["policy_version"]
        assert adapters[name].weights_digest == adapter_digest(run_dir, name), f"{name} serves other weights"
        assert adapters[name].adapter.rank == 8
    assert served.policy_version == 0 and not served.weights_digest, "a run pushed the base weights"

    evaluate_with_the_adapter(tmp_path, "team-a")


def evaluate_with_the_adapter(tmp_path: Path, name: str) -> None:
    """`sciproto eval --checkpoint` of a LoRA run serves the base and pushes the adapter, and samples with it:
    the random base scores near 0 on the toy task, the trained adapter above 0.8."""
    env = start_server(["serve", "env", "--env", "toy", "--port", "0"], timeout_s=120)
    try:
        report_path = tmp_path / "eval.json"
        done = subprocess.run([sys.executable, "-m", "sciproto", "eval", "--env", env.target, "--tasks", "toy:test",
                               "--checkpoint", str(tmp_path / name), "--limit", "16",
                               "--output", str(report_path)], capture_output=True, text=True, timeout=240, check=False)
    finally:
        env.stop()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert f"adapter {name!r} on tiny" in report["policy"]
    assert report["passes"]["greedy"]["mean_reward"] > 0.8, report["passes"]["greedy"]
