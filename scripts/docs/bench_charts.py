"""Draw the benchmarks page's charts (docs/images/bench-*.svg) from bench/results/figures.json:
`python scripts/docs/bench_charts.py`. The output is the same for the same figures (no dates or
random ids in the SVG), so a test can check the committed charts are up to date."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("svg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ROOT / "bench/results/figures.json"
OUT = ROOT / "docs/images"
TEAL, GREY, INDIGO, AMBER, PLUM = "#00897b", "#9e9e9e", "#3f51b5", "#ef6c00", "#8e24aa"


def _save(figure: plt.Figure, name: str, out: Path) -> Path:
    path = out / f"bench-{name}.svg"
    figure.tight_layout()
    figure.savefig(path, format="svg", metadata={"Date": None, "Creator": None})
    plt.close(figure)
    return path


def env_step(run: dict, out: Path) -> Path:
    figure, axis = plt.subplots(figsize=(6.4, 3.0))
    labels, lows, highs = [], [], []
    for key, title in (("session_over_aviary_http", "over Aviary's HTTP server"),
                       ("session_over_in_process", "over Aviary in-process")):
        for episodes, (low, high) in run[key].items():
            labels.append(f"{title}, {episodes} episodes")
            lows.append(low)
            highs.append(high)
    rows = range(len(labels))
    axis.barh(rows, lows, color=TEAL, label="lowest of 3 runs")
    axis.barh(rows, [h - lo for lo, h in zip(lows, highs)], left=lows, color="#80cbc4", label="highest")
    axis.axvline(1.0, color=GREY, linestyle="--", linewidth=1)
    axis.set_yticks(list(rows), labels)
    axis.invert_yaxis()
    axis.set_xlabel("env server Session stream: steps/s, times the other")
    axis.legend(loc="lower right", frameon=False)
    return _save(figure, "env-step", out)


def real_model(run: dict, out: Path) -> Path:
    figure, axis = plt.subplots(figsize=(6.4, 2.8))
    names = ["base model", *run["trained"]]
    values = [run["base"], *run["trained"].values()]
    centres = [v[0] for v in values]
    errors = [[v[0] - v[1] for v in values], [v[2] - v[0] for v in values]]
    colours = [GREY] + [TEAL] * (len(names) - 1)
    axis.barh(range(len(names)), centres, xerr=errors, color=colours, capsize=4)
    axis.set_yticks(range(len(names)), names)
    axis.invert_yaxis()
    axis.set_xlim(0, 1)
    axis.set_xlabel("held-out pass@1 with its 95% interval (SmolLM2-135M, 30 min of GRPO on a CPU)")
    return _save(figure, "real-model", out)


def gateway(run: dict, out: Path) -> Path:
    figure, axis = plt.subplots(figsize=(6.4, 2.4))
    ways = list(run["tokens_per_s_over_generate"])
    values = list(run["tokens_per_s_over_generate"].values())
    centres = [v[0] for v in values]
    errors = [[v[0] - v[1] for v in values], [v[2] - v[0] for v in values]]
    axis.barh(range(len(ways)), centres, xerr=errors, color=INDIGO, capsize=4)
    axis.axvline(1.0, color=GREY, linestyle="--", linewidth=1)
    axis.set_yticks(range(len(ways)), ways)
    axis.invert_yaxis()
    axis.set_xlabel("tokens/s through the gateway, times Generate directly (median, range of 8 runs)")
    return _save(figure, "gateway", out)


def train(run: dict, out: Path) -> Path:
    figure, (left, right) = plt.subplots(1, 2, figsize=(6.4, 2.6))
    keys = list(run["steps_per_s_over_sync"])
    left.bar(keys, list(run["steps_per_s_over_sync"].values()), color=TEAL)
    left.axhline(1.0, color=GREY, linestyle="--", linewidth=1)
    left.set_ylabel("steps/s, times K=0")
    right.bar(keys, list(run["generation_idle_s"].values()), color=INDIGO)
    right.set_ylabel("generation idle, s of 100")
    for axis in (left, right):
        axis.set_xlabel("learner.grpo.max_staleness")
    return _save(figure, "train", out)


def learning_curve(run: dict, out: Path) -> Path:
    figure, axis = plt.subplots(figsize=(6.4, 3.4))
    base = run["base"]
    axis.axhspan(base[1], base[2], color=GREY, alpha=0.25, linewidth=0)
    axis.axhline(base[0], color=GREY, linestyle="--", linewidth=1, label="base model")
    # the runs before a change dashed and unshaded; each run after it with its intervals
    for (name, points), colour in zip(run["curves"].items(), (INDIGO, PLUM, TEAL, AMBER, "#c62828", "#2e7d32", "#6d4c41"), strict=False):
        seconds = [0] + [p[0] for p in points]
        centres = [base[0]] + [p[1] for p in points]
        before = name in run.get("before", [])
        axis.plot(seconds, centres, marker="o", markersize=3, color=colour, label=name,
                  linestyle="--" if before else "-", linewidth=1 if before else 1.5)
        if not before:
            axis.fill_between([p[0] for p in points], [p[2] for p in points], [p[3] for p in points],
                              color=colour, alpha=0.12, linewidth=0)
    axis.set_ylim(0, 1)
    axis.set_xlabel("seconds of training (SmolLM2-135M, GRPO on a CPU)")
    axis.set_ylabel("held-out pass@1")
    axis.legend(loc="upper left", frameon=False, fontsize=7)
    return _save(figure, "learning-curve", out)


CHARTS = {"env_step": env_step, "real_model": real_model, "gateway_overhead": gateway, "train": train,
          "learning_curve": learning_curve}


def draw(out: Path = OUT) -> list[Path]:
    plt.rcParams.update({"svg.hashsalt": "sciproto", "font.size": 9, "axes.spines.top": False,
                         "axes.spines.right": False, "svg.fonttype": "none"})
    runs = json.loads(FIGURES.read_text())["runs"]
    out.mkdir(parents=True, exist_ok=True)
    return [chart(runs[name], out) for name, chart in CHARTS.items()]


if __name__ == "__main__":
    for written in draw(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT):
        print(written.relative_to(ROOT) if written.is_relative_to(ROOT) else written)
