"""`sciproto eval`: pass rates of a policy on a task split, and which tasks are worth training on.

    sciproto eval --env 127.0.0.1:50051 --policy 127.0.0.1:50052 --tasks gsm8k:test
    sciproto eval --env 127.0.0.1:50051 --checkpoint runs/arith/checkpoints/step_00000040 --tasks gsm8k:short_test
    sciproto eval --env ... --policy ... --tasks gsm8k:short_train --no-greedy --samples 8 \\
        --write-curriculum curriculum.json

Runs the agent loop (`clients.collect`) over the first `--limit` tasks of the split in up to two
passes: greedy (one sample per task at temperature 0, on by default) and sampled (`--samples K` per
task at `sampling.temperature`, seeded by `sampling.seed`). Each pass reports pass@1 and pass@k with
a confidence interval, per-task pass rates, token, turn and time statistics and why episodes ended
(`clients.eval_report`); a sampled pass with K >= 2 adds the reward analysis (the fraction of tasks
whose outcomes are mixed, a histogram of passes per task). The report is printed and written as JSON
(`--output`, schema `sciproto.eval/1`), the rollouts beside it (`<stem>.<pass>.jsonl`, which
`sciproto view` opens), and `--write-curriculum FILE` keeps the sampled pass's tasks whose pass rate
is strictly between `--min-pass-rate` and `--max-pass-rate` (default: the mixed ones) for
`sciproto train` (`rollout.curriculum`).

`--checkpoint DIR` evaluates a training checkpoint instead of a running server: a policy server
child process starts with the run's base model (`policy.model` of the run's config.yaml, or
`--model`), takes the checkpoint's weights over UpdateWeights, serves the evaluation and stops. DIR is
a checkpoint folder (`.../checkpoints/step_N`) or a run directory (its latest checkpoint).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from clients.agent import EnvPool, PolicyPool, env_pool, policy_pool
from clients.collect import (
    ReplicaSettings,
    collect,
    parse_tasks,
    split_size,
    tasks_of,
    tasks_to_run,
)
from clients.eval_report import EndReason, PassReport, analyse_pass, curriculum_of
from sciproto.channel import ServerAccess, make_channel
from sciproto.client.policy import PolicyClient
from sciproto.client.rollouts import RolloutRecord
from sciproto.config import load_config
from sciproto.processes import ServerProcess, start_server
from sciproto.rundir import (
    CONFIG_FILE,
    MANIFEST_FILE,
    WEIGHTS_FILE,
    is_checkpoint,
    latest_checkpoint,
)
from sciproto.sampling import EpisodeSettings, Sampling
from sciproto.tracing import TracingConfig, client_interceptors, setup_tracing, shutdown_tracing

log = logging.getLogger(__name__)

REPORT_SCHEMA = "sciproto.eval/1"
TIED_ALIAS = "lm_head.weight"


class EvalError(ValueError):
    """Bad `sciproto eval` input; the message says what to fix."""


class CheckpointServing(BaseModel):
    """The policy server `--checkpoint` starts."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="Base model spec; default: policy.model of the run's config.yaml")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype the checkpoint is served in (auto: the policy server picks, bfloat16 on a CPU with AMX)")
    threads: int = Field(0, ge=0, description="torch/OpenMP threads of the server (0: library default)")
    start_timeout_s: float = Field(300.0, gt=0, description="Longest wait for the server to announce its port")
    stop_timeout_s: float = Field(60.0, gt=0, description="Longest wait after SIGTERM before SIGKILL")
    push_timeout_s: float = Field(300.0, gt=0, description="Longest the checkpoint's weight push may take")


class EvalConfig(EpisodeSettings):
    """Settings of `sciproto eval` (addresses, tasks and counts come from the command line): how
    each episode is played (sciproto.sampling.EpisodeSettings), and the report."""

    model_config = ConfigDict(extra="forbid")

    sampling: Sampling = Field(default_factory=lambda: Sampling(seed=0),
                               description="The sampled pass's sampling; the greedy pass uses temperature 0")
    success_reward: float = Field(1.0, description="A rollout passes when its reward is at least this")
    confidence: float = Field(0.95, gt=0, lt=1, description="Of the pass@k intervals")
    replicas: ReplicaSettings = Field(default_factory=ReplicaSettings)
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    env_access: ServerAccess = Field(default_factory=ServerAccess, description="Token and TLS of the env servers")
    policy_access: ServerAccess = Field(default_factory=ServerAccess, description="Token and TLS of the policy servers")
    checkpoint: CheckpointServing = Field(default_factory=CheckpointServing)
    progress: bool = Field(True, description="Show a progress bar")


class EvalReport(BaseModel):
    schema_: str = Field(REPORT_SCHEMA, alias="schema")
    env: str
    split: str
    tasks: int = Field(description="Tasks evaluated: the first N of the split")
    policy: str = Field(description="The policy server, or the checkpoint it served")
    model: str
    policy_version: int
    passes: dict[str, PassReport]
    seconds: float
    created_unix: float


# ---------------------------------------------------------------------- checkpoints


def checkpoint_folder(path: Path) -> Path:
    """`path` if it is a checkpoint, else the latest checkpoint of the run directory `path`."""
    if is_checkpoint(path):
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise EvalError(f"{path} is neither a checkpoint (no {MANIFEST_FILE}) nor a run directory with"
                        " checkpoints/step_*; pass one of those")
    return latest


def base_model_of(checkpoint: Path, explicit: str | None) -> tuple[str, int]:
    """(model spec, seed) the checkpoint's run trained: from its run's config.yaml, or `explicit`."""
    config_path = checkpoint.parent.parent / CONFIG_FILE
    policy: dict = {}
    if config_path.is_file():
        policy = (yaml.safe_load(config_path.read_text()) or {}).get("policy") or {}
    model = explicit or policy.get("model")
    if not model:
        raise EvalError(f"cannot tell which base model {checkpoint} was trained from ({config_path} has no"
                        " policy.model): pass --model")
    return str(model), int(policy.get("seed", 0))


def retie(weights: dict) -> dict:
    """The checkpoint's weights with each tied parameter under one name again.

    A checkpoint stores a tied parameter once per name, as equal copies (safetensors refuses shared
    memory), while the policy server's manifest names it once: Hugging Face models tie the output
    projection to the input embedding and list `lm_head.weight` as the alias. Of equal tensors of
    one shape, the alias names are dropped (the first name is kept when none is an alias)."""
    groups: dict[tuple, list[list[str]]] = {}
    for name, tensor in weights.items():
        flat = tensor.reshape(-1)
        key = (tuple(tensor.shape), tensor.dtype, *flat[:4].tolist(), *flat[-4:].tolist())
        twins = next((g for g in groups.get(key, []) if weights[g[0]].equal(tensor)), None)
        if twins is None:
            groups.setdefault(key, []).append([name])
        else:
            twins.append(name)
    kept = {}
    for group in (g for same_key in groups.values() for g in same_key):
        originals = [n for n in group if not n.endswith(TIED_ALIAS)] or group
        kept[originals[0]] = weights[originals[0]]
    return kept


def checkpoint_adapter(path: Path) -> str:
    """The name of the LoRA adapter a checkpoint holds ("" for full weights): what an evaluation of
    it samples with, once `serve_checkpoint` has pushed it."""
    manifest = json.loads((checkpoint_folder(path) / MANIFEST_FILE).read_text())
    return (manifest.get("lora") or {}).get("spec", {}).get("name", "")


@contextlib.asynccontextmanager
async def serve_checkpoint(path: Path, settings: CheckpointServing, log_file: Path | None = None
                           ) -> AsyncIterator[tuple[str, str]]:
    """A policy server child serving the checkpoint's weights; yields (target, description). A LoRA
    checkpoint's adapter is pushed under its name beside the base (`checkpoint_adapter`)."""
    import torch  # only a checkpoint needs torch here
    from safetensors.torch import load_file

    from sciproto.lora import LoraSpec
    from sciproto.weights.wire import PROTO_TO_DTYPE

    folder = checkpoint_folder(path)
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    model, seed = base_model_of(folder, settings.model)
    lora = manifest.get("lora")
    threads = {"OMP_NUM_THREADS": str(settings.threads), "MKL_NUM_THREADS": str(settings.threads)}
    process: ServerProcess = await asyncio.to_thread(
        start_server, ["serve", "policy", "--model", model, "--port", "0", "--set", f"dtype={settings.dtype}",
                       "--set", f"seed={seed}"],
        timeout_s=settings.start_timeout_s, log_file=log_file, env=threads if settings.threads else None)
    try:
        client = PolicyClient(make_channel(process.target))
        version = max(1, int(manifest.get("policy_version", 0)))
        try:
            # The weights go in the dtype the server says it serves (it resolves `auto` itself).
            served = PROTO_TO_DTYPE[(await client.describe(timeout_s=settings.push_timeout_s)).dtype]
            weights = {name: tensor.to(getattr(torch, served)) if tensor.is_floating_point() else tensor
                       for name, tensor in load_file(str(folder / WEIGHTS_FILE)).items()}
            if lora:
                await client.push_weights(weights, version, timeout_s=settings.push_timeout_s,
                                          adapter=LoraSpec(**lora["spec"]).to_proto())
            else:
                await client.push_weights(retie(weights), version, timeout_s=settings.push_timeout_s)
        finally:
            await client.close()
        what = f"adapter {lora['spec']['name']!r} on {model}" if lora else model
        yield process.target, f"{folder} ({what}, step {manifest.get('step')})"
    finally:
        await asyncio.to_thread(process.stop, settings.stop_timeout_s)


# ---------------------------------------------------------------------- passes


async def run_pass(name: str, *, env: EnvPool, policy: PolicyPool, env_name: str, split: str, count: int, samples: int,
                   sampling: Sampling, concurrency: int, config: EvalConfig, rollouts_path: Path | None,
                   adapter: str = "") -> PassReport:
    """One pass over tasks 0..count-1 with `samples` each; its rollouts go to `rollouts_path`."""
    records: list[RolloutRecord] = []
    started = time.monotonic()
    bar = tqdm(total=count * samples, unit="rollout", desc=name, disable=not config.progress, dynamic_ncols=True)
    sink = rollouts_path.open("w", encoding="utf-8") if rollouts_path else None
    try:
        async for group in collect(tasks_of(env_name, split, count), env=env, policy=policy, samples=samples,
                                   concurrency=concurrency, sampling=sampling, max_steps=config.max_steps,
                                   max_tokens=config.max_tokens, retries=config.retries,
                                   deadlines=config.deadlines, adapter=adapter):
            records += group.rollouts
            if sink:
                sink.writelines(r.to_json_line() for r in group.rollouts)
                sink.flush()
            bar.update(len(group.rollouts))
    finally:
        bar.close()
        if sink:
            sink.close()
    return analyse_pass(name, records, temperature=sampling.temperature, samples=samples, seed=sampling.seed,
                        max_steps=config.max_steps, max_tokens=config.max_tokens,
                        success_reward=config.success_reward, wall_s=time.monotonic() - started,
                        confidence=config.confidence)


async def evaluate(env_targets: Sequence[str], policy_targets: Sequence[str], tasks: str, *, limit: int | None,
                   greedy: bool, samples: int, concurrency: int, config: EvalConfig, output: Path | None,
                   policy_label: str | None = None, adapter: str = "") -> EvalReport:
    """Run the passes against running servers and return the report (rollouts beside `output`);
    `adapter` names the policy servers' LoRA adapter to sample with ("": the base weights)."""
    env_name, split = parse_tasks(tasks)
    started = time.monotonic()
    interceptors = client_interceptors(config.tracing)
    options = config.replicas.model_dump()
    env_channels = [config.env_access.channel(t) for t in env_targets]
    policy_channels = [config.policy_access.channel(t) for t in policy_targets]
    async with env_pool(env_channels, interceptors=interceptors, **options) as env, \
            policy_pool(policy_channels, interceptors=interceptors, **options) as policy:
        size = await split_size(env, env_name, split, config.deadlines.describe_s)
        count = tasks_to_run(size, limit, tasks)
        async with policy.lease() as replica:
            described = await replica.client.describe(timeout_s=config.deadlines.describe_s)
        plan = ([("greedy", 1, config.sampling.model_copy(update={"temperature": 0.0}))] if greedy else []) + \
               ([("sampled", samples, config.sampling)] if samples else [])
        passes = {}
        for name, k, sampling in plan:
            rollouts_path = output.with_name(f"{output.stem}.{name}.jsonl") if output else None
            passes[name] = await run_pass(name, env=env, policy=policy, env_name=env_name, split=split, count=count,
                                          samples=k, sampling=sampling, concurrency=concurrency, config=config,
                                          rollouts_path=rollouts_path, adapter=adapter)
    return EvalReport(env=env_name, split=split, tasks=count, policy=policy_label or ",".join(policy_targets),
                      model=described.model, policy_version=described.policy_version, passes=passes,
                      seconds=round(time.monotonic() - started, 3), created_unix=time.time())


async def run_eval(env_targets: Sequence[str], policy_targets: Sequence[str], checkpoint: Path | None, tasks: str,
                   *, limit: int | None, greedy: bool, samples: int, concurrency: int, config: EvalConfig,
                   output: Path | None) -> EvalReport:
    if checkpoint is None:
        return await evaluate(env_targets, policy_targets, tasks, limit=limit, greedy=greedy, samples=samples,
                              concurrency=concurrency, config=config, output=output)
    log_file = output.with_name(f"{output.stem}.policy.log") if output else None
    async with serve_checkpoint(checkpoint, config.checkpoint, log_file) as (target, label):
        return await evaluate(env_targets, [target], tasks, limit=limit, greedy=greedy, samples=samples,
                              concurrency=concurrency, config=config, output=output, policy_label=label,
                              adapter=checkpoint_adapter(checkpoint))


# ---------------------------------------------------------------------- the command


def _interval(report: PassReport, key: str) -> str:
    estimate = report.pass_at.get(key)
    return "-" if estimate is None else f"{estimate.value:.3f} [{estimate.low:.3f}, {estimate.high:.3f}]"


def print_report(report: EvalReport, output: Path | None, console: Console | None = None) -> None:
    table = Table(title=f"sciproto eval: {report.env}:{report.split}, {report.tasks} tasks, {report.model}"
                        f" (policy version {report.policy_version})")
    table.add_column("figure")
    for name in report.passes:
        table.add_column(name, justify="right")
    passes = list(report.passes.values())
    ks = sorted({k for p in passes for k in p.pass_at}, key=lambda k: int(k.split("@")[1]))
    rows: list[tuple[str, list[str]]] = [
        ("samples per task / temperature", [f"{p.samples} / {p.temperature:g}" for p in passes]),
        *((f"{k} [{passes[0].pass_at[k].tasks if k in passes[0].pass_at else '-'} tasks, CI]",
           [_interval(p, k) for p in passes]) for k in ks),
        ("mean reward", ["-" if p.mean_reward is None else f"{p.mean_reward:.3f}" for p in passes]),
        ("scored / unscored / infra errors", [f"{p.scored} / {p.unscored} / {p.infra_errors}" for p in passes]),
        *((f"ended: {reason}", [str(p.end_reasons[reason]) for p in passes]) for reason in EndReason),
        ("completion tokens mean / p90 / max", [f"{p.completion_tokens.mean:.0f} / {p.completion_tokens.p90:.0f} /"
                                                f" {p.completion_tokens.max:.0f}" for p in passes]),
        ("turns mean / max", [f"{p.turns.mean:.2f} / {p.turns.max:.0f}" for p in passes]),
        ("replies with a well-formed tool call", ["-" if p.tool_call_reply_frac is None
                                                  else f"{p.tool_call_reply_frac:.3f}" for p in passes]),
        ("tool calls per episode mean / max", [f"{p.tool_calls.mean:.2f} / {p.tool_calls.max:.0f}" for p in passes]),
        ("completion tokens/s", [f"{p.completion_tokens_per_s:.1f}" for p in passes]),
        ("wall s", [f"{p.wall_s:.1f}" for p in passes]),
    ]
    analyses = [p.reward_analysis for p in passes]
    if any(analyses):
        def each(show) -> list[str]:
            return [show(a) if a else "-" for a in analyses]

        rows += [("tasks with mixed outcomes (0 < p < 1)", each(lambda a: f"{a.frac_mixed:.3f}")),
                 ("tasks whose rewards differ (GRPO signal)", each(lambda a: f"{a.frac_rewards_differ:.3f}")),
                 ("tasks all pass / all fail", each(lambda a: f"{a.frac_all_pass:.3f} / {a.frac_all_fail:.3f}")),
                 ("tasks by passes 0..K", each(lambda a: " ".join(str(v) for v in a.passes_histogram.values())))]
    for label, values in rows:
        table.add_row(label, *values)
    console = console or Console()
    console.print(table)
    if output:
        console.print(f"report: {output}")


def main(*, env: list[str], policy: list[str], checkpoint: Path | None, tasks: str, output: Path | None,
         limit: int | None = None, greedy: bool = True, samples: int = 0, concurrency: int = 16,
         write_curriculum: Path | None = None, min_pass_rate: float = 0.0, max_pass_rate: float = 1.0,
         model: str | None = None, config: str | None = None, overrides: Sequence[str] = ()) -> EvalReport:
    """`sciproto eval`: see the module docstring."""
    if bool(policy) == (checkpoint is not None):
        raise EvalError("give either --policy HOST:PORT (a running server) or --checkpoint DIR, not both or neither")
    if not greedy and samples < 1:
        raise EvalError("nothing to run: --no-greedy needs --samples K (K >= 1)")
    if samples < 0 or concurrency < 1:
        raise EvalError(f"--samples ({samples}) must be >= 0 and --concurrency ({concurrency}) >= 1")
    if limit is not None and limit < 1:
        raise EvalError(f"--limit must be >= 1, got {limit}")
    if write_curriculum is not None and samples < 2:
        raise EvalError("--write-curriculum needs a sampled pass of --samples K >= 2 (pass rates of 0 or 1 from"
                        " one sample say nothing about mixed outcomes)")
    if not 0 <= min_pass_rate < max_pass_rate <= 1:
        raise EvalError(f"need 0 <= --min-pass-rate < --max-pass-rate <= 1, got {min_pass_rate}, {max_pass_rate}")
    parse_tasks(tasks)
    settings = load_config(EvalConfig, config, list(overrides) + ([f"checkpoint.model={model}"] if model else []))
    if output:
        output.parent.mkdir(parents=True, exist_ok=True)
    setup_tracing(settings.tracing, "sciproto-eval")
    try:
        report = asyncio.run(run_eval(env, policy, checkpoint, tasks, limit=limit, greedy=greedy, samples=samples,
                                      concurrency=concurrency, config=settings, output=output))
    finally:
        shutdown_tracing()
    if output:
        output.write_text(report.model_dump_json(by_alias=True, indent=2) + "\n")
    print_report(report, output)
    if write_curriculum is not None:
        curriculum = curriculum_of(report.passes["sampled"], report.env, report.split, min_pass_rate=min_pass_rate,
                                   max_pass_rate=max_pass_rate,
                                   source={"policy": report.policy, "model": report.model,
                                           "policy_version": report.policy_version,
                                           "created_unix": report.created_unix})
        curriculum.write(write_curriculum)
        Console().print(f"curriculum: {len(curriculum.indices)} of {report.tasks} tasks with"
                        f" {min_pass_rate:g} < pass rate < {max_pass_rate:g} -> {write_curriculum}")
    return report


def eval_config_for_run(config: str, overrides: list[str]) -> EvalConfig:
    """How a training config's checkpoints are evaluated: its episode limits and sampling (seed 0),
    served as its policy is (model, dtype)."""
    from clients.train import load_train_config

    train = load_train_config(config, overrides)
    return EvalConfig(max_steps=train.rollout.max_steps, max_tokens=train.rollout.max_tokens,
                      sampling=train.rollout.sampling.model_copy(update={"seed": 0}), progress=False,
                      checkpoint=CheckpointServing(model=train.policy.model, dtype=train.policy.dtype))


__all__ = [
    "CheckpointServing",
    "EvalConfig",
    "EvalError",
    "EvalReport",
    "checkpoint_adapter",
    "eval_config_for_run",
    "evaluate",
    "main",
    "run_eval",
    "serve_checkpoint",
]
