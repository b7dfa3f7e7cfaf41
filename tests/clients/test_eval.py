"""`sciproto eval` and the curriculum writer against real env and policy server processes (tiny model)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from clients.curriculum import CurriculumError, read_curriculum
from clients.eval import EvalConfig, EvalError, EvalReport, evaluate, main, run_eval
from clients.eval_report import EndReason, end_reason, wilson_interval
from clients.train import load_train_config
from sciproto.client.rollouts import (
    MessageRecord,
    RolloutRecord,
    RolloutStatus,
    TokenCounts,
    read_rollouts,
)
from sciproto.config import ConfigError
from sciproto.models.loading import load_model
from sciproto.processes import ServerProcess

# The tiny random model writes a few digits now and then: "passing" = any digit at all gives
# tasks with mixed outcomes, which is what the reward analysis and the curriculum are about.
TOY = ["sampling.max_tokens=16", "max_steps=1", "progress=false", "success_reward=0.01"]


def _eval(env: ServerProcess, policy: ServerProcess, tmp_path: Path, **options: object) -> EvalReport:
    arguments = {"env": [env.target], "policy": [policy.target], "checkpoint": None, "tasks": "toy:train",
                 "output": tmp_path / "report.json", "limit": 6, "overrides": TOY} | options
    return main(**arguments)  # type: ignore[arg-type]


def test_report_has_pass_at_k_intervals_end_reasons_and_rollouts(env_server: ServerProcess,
                                                                 policy_server: ServerProcess,
                                                                 tmp_path: Path) -> None:
    report = _eval(env_server, policy_server, tmp_path, samples=4, concurrency=24)

    written = json.loads((tmp_path / "report.json").read_text())
    assert written["schema"] == "sciproto.eval/1"
    assert set(written["passes"]) == {"greedy", "sampled"}
    greedy, sampled = report.passes["greedy"], report.passes["sampled"]
    assert (greedy.samples, greedy.temperature, greedy.rollouts) == (1, 0.0, 6)
    assert (sampled.samples, sampled.rollouts) == (4, 24)
    assert set(greedy.pass_at) == {"pass@1"} and set(sampled.pass_at) == {"pass@1", "pass@2", "pass@4"}
    for estimate in sampled.pass_at.values():
        assert estimate.tasks == 6 and estimate.low <= estimate.value <= estimate.high
    # pass@k grows with k, and pass@1 is the mean per-task pass rate.
    values = [sampled.pass_at[k].value for k in ("pass@1", "pass@2", "pass@4")]
    assert values == sorted(values)
    assert values[0] == pytest.approx(sum(t.pass_rate for t in sampled.per_task) / 6, abs=1e-3)
    # Every rollout has exactly one end reason; one-turn toy episodes end by the environment.
    assert sum(sampled.end_reasons.values()) == 24
    assert sampled.end_reasons[EndReason.ANSWERED] + sampled.end_reasons[EndReason.INVALID_TOOL_CALL] == 24
    assert sampled.turns.max == 1 and 0 < sampled.completion_tokens.mean <= 16
    analysis = sampled.reward_analysis
    assert analysis is not None and sum(analysis.passes_histogram.values()) == 6
    assert analysis.frac_mixed == pytest.approx(sum(0 < t.passes < 4 for t in sampled.per_task) / 6, abs=1e-3)
    assert analysis.frac_rewards_differ > 0, "the tiny model's samples should not all score alike"
    # The rollouts are kept beside the report, one file per pass.
    assert len(list(read_rollouts(tmp_path / "report.greedy.jsonl"))) == 6
    assert len(list(read_rollouts(tmp_path / "report.sampled.jsonl"))) == 24


def test_greedy_pass_is_deterministic(env_server: ServerProcess, policy_server: ServerProcess, tmp_path: Path) -> None:
    config = EvalConfig.model_validate({"sampling": {"max_tokens": 16}, "max_steps": 1, "progress": False})

    async def once(name: str) -> list[list[int]]:
        await evaluate([env_server.target], [policy_server.target], "toy:train", limit=4, greedy=True, samples=0,
                       concurrency=4, config=config, output=tmp_path / f"{name}.json")
        records = sorted(read_rollouts(tmp_path / f"{name}.greedy.jsonl"), key=lambda r: r.index)
        return [r.token_ids for r in records]

    assert asyncio.run(once("a")) == asyncio.run(once("b"))


def test_curriculum_lists_the_mixed_tasks_and_train_takes_it(env_server: ServerProcess, policy_server: ServerProcess,
                                                              tmp_path: Path) -> None:
    curriculum_path = tmp_path / "curriculum.json"
    report = _eval(env_server, policy_server, tmp_path, greedy=False, samples=6, concurrency=36, limit=8,
                   write_curriculum=curriculum_path)

    curriculum = read_curriculum(curriculum_path)
    mixed = [t for t in report.passes["sampled"].per_task if 0 < t.passes < t.samples]
    assert mixed, "expected some tasks with mixed outcomes from the tiny model"
    assert curriculum.tasks == "toy:train"
    assert curriculum.indices == [t.index for t in mixed]
    assert curriculum.pass_rates == {str(t.index): t.pass_rate for t in mixed}
    assert curriculum.samples == 6 and curriculum.source["policy"] == policy_server.target

    # sciproto train accepts it for the same split and refuses it for another.
    config = load_train_config("demo", [f"rollout.curriculum={curriculum_path}"])
    assert config.rollout.curriculum == curriculum_path
    with pytest.raises(ConfigError, match="lists tasks of toy:train"):
        load_train_config("demo", [f"rollout.curriculum={curriculum_path}", "rollout.tasks=gsm8k:train",
                                   "env.envs=[gsm8k,toy]"])


def test_a_curriculum_must_list_tasks(tmp_path: Path) -> None:
    path = tmp_path / "empty.json"
    path.write_text(json.dumps({"schema": "sciproto.curriculum/1", "env": "toy", "split": "train", "indices": []}))
    with pytest.raises(CurriculumError, match="lists no tasks"):
        read_curriculum(path)
    with pytest.raises(CurriculumError, match="does not exist"):
        read_curriculum(tmp_path / "missing.json")


def _tiny_checkpoint(tmp_path: Path, version: int) -> Path:
    """A run directory holding one checkpoint: the tiny model's weights, perturbed."""
    weights = load_model("tiny").model.state_dict()
    generator = torch.Generator().manual_seed(1)
    by_storage: dict[int, torch.Tensor] = {}  # tied parameters (embedding = lm_head) get the same change
    perturbed = {}
    for name, tensor in weights.items():
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in by_storage:
            noise = 0.5 * torch.randn(tensor.shape, generator=generator) if tensor.is_floating_point() else 0
            by_storage[pointer] = tensor + noise
        perturbed[name] = by_storage[pointer].clone()  # as the learner saves them: one copy per name
    run_dir = tmp_path / "run"
    folder = run_dir / "checkpoints" / "step_00000007"
    folder.mkdir(parents=True)
    save_file(perturbed, str(folder / "model.safetensors"))
    (folder / "manifest.json").write_text(json.dumps({"step": 7, "policy_version": version}))
    (folder / "learner_state.json").write_text("{}")  # written last by the learner: the checkpoint is complete
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"policy": {"model": "tiny", "seed": 0}}))
    return run_dir


def test_eval_of_a_checkpoint_serves_its_weights(env_server: ServerProcess, policy_server: ServerProcess,
                                                 tmp_path: Path) -> None:
    run_dir = _tiny_checkpoint(tmp_path, version=7)
    config = EvalConfig.model_validate({"sampling": {"max_tokens": 16}, "max_steps": 1, "progress": False})

    trained = asyncio.run(run_eval([env_server.target], [], run_dir, "toy:train", limit=3, greedy=True, samples=0,
                                   concurrency=3, config=config, output=tmp_path / "trained.json"))
    base = asyncio.run(run_eval([env_server.target], [policy_server.target], None, "toy:train", limit=3, greedy=True,
                                samples=0, concurrency=3, config=config, output=tmp_path / "base.json"))

    assert trained.policy_version == 7 and base.policy_version == 0
    assert "step_00000007" in trained.policy
    completions = {name: [r.token_ids for r in sorted(read_rollouts(tmp_path / f"{name}.greedy.jsonl"),
                                                      key=lambda r: r.index)] for name in ("trained", "base")}
    assert completions["trained"] != completions["base"], "the checkpoint's weights were not the ones served"


def test_eval_command_errors_are_one_line(tmp_path: Path) -> None:
    def run(*arguments: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "sciproto", "eval", "--env", "127.0.0.1:1", "--tasks",
                               "toy:train", "--output", str(tmp_path / "r.json"), *arguments],
                              capture_output=True, text=True, timeout=120, check=False,
                              env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})

    neither = run()
    assert neither.returncode == 2
    assert neither.stderr.strip().splitlines() == [
        ("sciproto eval: EvalError: give either --policy HOST:PORT (a running server) or --checkpoint DIR,"
         " not both or neither")]
    missing = run("--checkpoint", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1
    assert "neither a checkpoint" in missing.stderr and "Traceback" not in missing.stderr
    curriculum = run("--policy", "127.0.0.1:1", "--write-curriculum", str(tmp_path / "c.json"))
    assert curriculum.returncode == 2 and "--samples K >= 2" in curriculum.stderr


def _record(messages: list[MessageRecord], **fields: object) -> RolloutRecord:
    values = {"rollout_id": "gsm8k/test/0/0", "group_id": "gsm8k/test/0", "env": "gsm8k", "split": "test",
              "index": 0, "sample": 0, "status": RolloutStatus.SCORED, "messages": messages} | fields
    return RolloutRecord(**values)  # type: ignore[arg-type]


def test_end_reasons() -> None:
    user = MessageRecord(role="user", content="2+2?")
    prose = MessageRecord(role="assistant", content="It is 4.")
    malformed = MessageRecord(role="assistant", content='<tool_call>{"name": submit}</tool_call>')
    assert end_reason(_record([user, prose], terminated=True, steps=1), 4, 100) is EndReason.ANSWERED
    assert end_reason(_record([user, malformed], truncated=True, steps=4), 4, 100) is EndReason.INVALID_TOOL_CALL
    refused = [user, prose, MessageRecord(role="tool", content="Invalid tool call: no tool named 'x'")]
    assert end_reason(_record(refused, terminated=True, steps=1), 4, 100) is EndReason.INVALID_TOOL_CALL
    assert end_reason(_record([user, prose], truncated=True, steps=4), 4, 100) is EndReason.STEP_LIMIT
    assert end_reason(_record([user, prose], truncated=True, steps=2, tokens=TokenCounts(prompt=60, completion=40)),
                      4, 100) is EndReason.TOKEN_LIMIT
    failed = _record([user], status=RolloutStatus.INFRA_ERROR, error="env down")
    assert end_reason(failed, 4, 100) is EndReason.INFRA_ERROR


def test_wilson_interval() -> None:
    low, high = wilson_interval(0, 10)
    assert low == 0.0 and 0.25 < high < 0.32  # 0 of 10 still allows ~28%
    low, high = wilson_interval(5, 10)
    assert low < 0.5 < high and high - low == pytest.approx(2 * (0.5 - low))


def test_main_refuses_a_bad_pass_rate_window(tmp_path: Path) -> None:
    with pytest.raises(EvalError, match="min-pass-rate"):
        main(env=["127.0.0.1:1"], policy=["127.0.0.1:2"], checkpoint=None, tasks="toy:train", output=None,
             samples=4, min_pass_rate=0.5, max_pass_rate=0.5)
