"""Step metrics of a training run: `<run_dir>/metrics.jsonl` always, TensorBoard or Weights &
Biases when chosen, and a PNG plot of reward and policy lag.

metrics.jsonl holds one JSON object per optimizer step, among them:

    step, policy_version, groups, reward_mean, reward_std, reward_min, reward_max,
    frac_all_equal_groups, loss, entropy, clip_frac_low, clip_frac_high, is_weight_mean,
    is_weight_max, is_frac_truncated, mismatch (= mismatch_engine on the tokens sampled whole at
    the learner's current version and staleness_shift on the others, weighted by stale_token_frac;
    null when a batch has no token of that kind), grad_norm, policy_lag_mean, policy_lag_max,
    groups settled since the previous step: groups_consumed, groups_dropped_stale (when this
    step took its batch), groups_refused_stale, groups_skipped_equal, groups_refused_invalid
    (on arrival); tokens_per_s_generation, tokens_per_s_training,
    wait_rollouts_s, train_s, weight_sync_s, time_s (seconds since the learner started),
    peak_rss_gb, peak_gpu_gb (the step's peak memory; learner/memory.py)

A resumed run appends to the same file, so the plot covers the whole run, after cutting it back
to where its checkpoint recorded the file ended (`truncate`): the lines of steps trained after
that checkpoint belong to steps the crash lost, which are trained again.
"""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path
from typing import Any

from learner.server_config import MetricsConfig
from sciproto.rundir import METRICS_FILE, PLOT_FILE, read_metrics


def plot_metrics(records: list[dict[str, Any]], output: Path, title: str = "") -> Path:
    """Reward mean (with min/max band) and policy lag against the optimizer step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display: render straight to a file
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    figure, (reward_axes, lag_axes) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    reward_axes.plot(steps, [r.get("reward_mean", math.nan) for r in records], label="mean")
    reward_axes.fill_between(
        steps,
        [r.get("reward_min", math.nan) for r in records],
        [r.get("reward_max", math.nan) for r in records],
        alpha=0.2,
        label="min-max",
    )
    reward_axes.set_ylabel("reward")
    reward_axes.legend(loc="lower right")
    reward_axes.grid(alpha=0.3)
    lag_axes.plot(steps, [r.get("policy_lag_mean", math.nan) for r in records], label="mean")
    lag_axes.plot(
        steps, [r.get("policy_lag_max", math.nan) for r in records], label="max", linestyle="--"
    )
    lag_axes.set_ylabel("policy lag (versions)")
    lag_axes.set_xlabel("optimizer step")
    lag_axes.legend(loc="upper right")
    lag_axes.grid(alpha=0.3)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=100)
    plt.close(figure)
    return output


class MetricsLogger:
    """Writes each step's metrics to every chosen sink."""

    def __init__(self, run_dir: Path, config: MetricsConfig, run_name: str = "") -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self.plot_path = self.run_dir / PLOT_FILE
        self.config = config
        self.run_name = run_name or self.run_dir.name
        self._file = self.path.open("a", encoding="utf-8")
        self._tensorboard: Any = None
        self._wandb: Any = None
        if config.backend == "tensorboard":
            writer_module = _optional_import("torch.utils.tensorboard", "tensorboard")
            self._tensorboard = writer_module.SummaryWriter(
                log_dir=str(self.run_dir / "tensorboard")
            )
        elif config.backend == "wandb":
            self._wandb = _optional_import("wandb", "wandb")
            self._wandb.init(
                project=config.wandb_project,
                name=self.run_name,
                dir=str(self.run_dir),
                resume="allow",
            )

    def position(self) -> int:
        """Bytes of metrics.jsonl written so far (every logged line is flushed): a checkpoint
        records it, and the learner resumed from that checkpoint `truncate`s the file there."""
        return self._file.tell()

    def truncate(self, position: int) -> int:
        """Cut metrics.jsonl at `position` (a checkpoint's `position()`): the lines after it are of
        steps the learner trained after that checkpoint, lost by a crash and trained again, or a
        line torn by the crash. Returns how many lines were dropped."""
        self._file.close()
        data = self.path.read_bytes()
        if len(data) > position:
            tail = data[position:]
            staging = self.path.with_suffix(".tmp")
            staging.write_bytes(data[:position])
            staging.replace(self.path)
            dropped = tail.count(b"\n") + (not tail.endswith(b"\n"))
        else:
            dropped = 0
        self._file = self.path.open("a", encoding="utf-8")
        return dropped

    def rewind(self, step: int) -> int:
        """Drop the lines of steps after `step` (the step the learner resumed at), and torn ones:
        for a checkpoint that did not record `position()` (or none). Returns how many lines were
        dropped."""
        self._file.close()
        lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True)
        kept = [line for line in lines if _step_of(line) is not None and _step_of(line) <= step]
        if len(kept) != len(lines):
            staging = self.path.with_suffix(".tmp")
            staging.write_text("".join(kept), encoding="utf-8")
            staging.replace(self.path)
        self._file = self.path.open("a", encoding="utf-8")
        return len(lines) - len(kept)

    def log(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        numbers = {
            k: float(v) for k, v in record.items() if isinstance(v, int | float) and k != "step"
        }
        if self._tensorboard is not None:
            for name, value in numbers.items():
                self._tensorboard.add_scalar(name, value, step)
        if self._wandb is not None:
            self._wandb.log(numbers, step=step)
        if step % self.config.plot_every == 0:
            self.plot()

    def plot(self) -> Path | None:
        records = read_metrics(self.path)
        if not records:
            return None
        return plot_metrics(records, self.plot_path, title=self.run_name)

    def close(self) -> None:
        self.plot()
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()


def _step_of(line: str) -> int | None:
    """The step of a metrics line; None for a blank line or one a crash tore."""
    try:
        return int(json.loads(line)["step"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


def _optional_import(module: str, package: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise RuntimeError(
            f"metrics.backend needs the {package!r} package ({error}); install it with "
            f"`pip install sciproto[{package}]` or set metrics.backend=none"
        ) from error
