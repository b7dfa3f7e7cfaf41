"""Every benchmark script starts: `python bench/X.py --help` exits 0. Python puts the script's own
folder, bench/, first on sys.path, so a bench script named like one of the project's top-level
packages (gateway, learner, clients, ...) hides that package from every other bench script that
imports it, however deep."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(path.name for path in (ROOT / "bench").glob("*.py"))
PACKAGES = sorted(path.parent.name for path in ROOT.glob("*/__init__.py"))


def load_bench(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_bench_script_is_named_like_a_package() -> None:
    assert PACKAGES, "no top-level package found"
    clashes = [name for name in SCRIPTS if name.removesuffix(".py") in PACKAGES]
    assert not clashes, f"bench scripts named like a top-level package, which they hide from bench/: {clashes}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_bench_script_starts(script: str) -> None:
    done = subprocess.run([sys.executable, f"bench/{script}", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage" in done.stdout.lower(), done.stdout[-500:]


def test_the_tool_use_bench_counts_the_groups_refused_for_having_no_signal() -> None:
    # The record of an hour-long `gsm8k_tools_smollm2_cpu` run: the learner refuses a group whose
    # rewards are all equal when it arrives, so no batch holds one and its frac_all_equal_groups is 0
    # at every step, while 51 of the 87 groups generated had no signal.
    bench = load_bench("real_model_tools")
    figures = bench.train_figures(ROOT / "tests" / "data" / "gsm8k_tools_run")
    assert (figures["sft_steps"], figures["grpo_steps"]) == (30, 9)
    assert figures["groups_generated"] == 87
    assert figures.get("groups_no_signal") == 51, figures
    assert figures["groups_no_signal_frac"] == 0.586, figures


def test_the_tool_use_bench_compares_the_checkpoints_task_by_task(tmp_path: Path) -> None:
    # Run 4's greedy evaluations of its SFT and GRPO checkpoints on gsm8k:test (60 tasks): the
    # intervals overlap (0.53 [0.41, 0.65] and 0.63 [0.51, 0.74]), and GRPO solved 6 tasks SFT had
    # failed while failing none SFT had solved: 2 * 0.5^6 = 0.031.
    bench = load_bench("real_model_tools")
    record = ROOT / "tests" / "data" / "gsm8k_tools_eval"
    before, after = record / "sft.test.eval.greedy.jsonl", record / "grpo.test.eval.greedy.jsonl"
    assert bench.paired(before, after) == {"tasks": 60, "fixed": 6, "broken": 0, "p": 0.0312}
    assert bench.paired(after, before) == {"tasks": 60, "fixed": 0, "broken": 6, "p": 0.0312}
    assert bench.paired(before, before) == {"tasks": 60, "fixed": 0, "broken": 0, "p": 1.0}
    fewer = tmp_path / "fewer.jsonl"
    fewer.write_text("".join(after.read_text().splitlines(keepends=True)[:59]))
    with pytest.raises(ValueError, match="different tasks"):
        bench.paired(before, fewer)
    # 16 fixed and none broken, as on run 5's short_test: p = 2 / 2**16, which must not read 0.0.
    records = [json.loads(line) for line in before.read_text().splitlines()]
    for name, solved in (("none", 0.0), ("all", 1.0)):
        (tmp_path / f"{name}.jsonl").write_text("".join(
            json.dumps(r | {"reward": solved if r["index"] < 16 else 1.0}) + "\n" for r in records))
    assert bench.paired(tmp_path / "none.jsonl", tmp_path / "all.jsonl")["p"] == pytest.approx(3.05e-5, rel=1e-2)


def test_the_real_model_bench_reads_its_learning_curve_from_the_checkpoints(tmp_path: Path) -> None:
    # A run that checkpointed at steps 2 and 4 (the last): each point takes its time and the groups
    # trained by then from the run's own files, and its gain from the evaluation given for it.
    bench = load_bench("real_model")
    run = tmp_path / "run"
    steps = [{"step": n, "seconds": 40.0 * n} for n in (1, 2, 3, 4)]
    (run / "checkpoints").mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"steps": steps}))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": n, "groups_consumed": 4 + n}) + "\n"
                                               for n in (1, 2, 3, 4)))
    for step in (2, 4):
        (run / "checkpoints" / f"step_{step:08d}").mkdir()
        (run / "checkpoints" / f"step_{step:08d}" / "manifest.json").write_text(json.dumps({"step": step}))
    base = {"pass@1": 0.24}
    evaluated = [(run / "checkpoints" / f"step_{step:08d}", {"pass@1": value, "low": value - 0.1, "high": value + 0.1})
                 for step, value in ((4, 0.62), (2, 0.41))]
    curve = bench.learning_curve(run, base, evaluated)
    assert [(p["step"], p["seconds"], p["groups_consumed"], p["gain_points"]) for p in curve] == [
        (2, 80.0, 11, 17.0), (4, 160.0, 26, 38.0)]


def test_the_time_to_a_gain_is_unknown_when_only_the_final_checkpoint_was_evaluated() -> None:
    # With --curve-every 0 the curve is the final checkpoint alone: past +30 there says the run got
    # there some time before its end, not when.
    bench = load_bench("real_model")
    point = {"step": 84, "seconds": 1193.6, "gain_points": 47.0}
    assert bench.seconds_to_gain([point], 30) is None
    # With earlier checkpoints evaluated, the first one at or past the gain bounds it.
    curve = [{"step": 8, "seconds": 140.0, "gain_points": 12.0}, {"step": 16, "seconds": 268.0, "gain_points": 30.0},
             point]
    assert bench.seconds_to_gain(curve, 30) == 268.0
    assert bench.seconds_to_gain(curve, 50) is None


def processes_naming(text: str) -> dict[int, str]:
    """pid -> command line of every process whose command line holds `text`."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in command:
                found[int(entry.name)] = command
    return found


@pytest.mark.slow
def test_a_killed_real_model_bench_leaves_no_training_run_behind(tmp_path: Path) -> None:
    """The bench runs `sciproto train` as a child; killed mid-run, it must take the run and the
    run's servers with it. (The tiny model: it evaluates 2 held-out tasks, then trains.)"""
    bench = subprocess.Popen([sys.executable, "bench/real_model.py", "--set", "policy.model=tiny", "--seconds", "600",
                              "--limit", "2", "--curve-every", "0", "--runs-dir", str(tmp_path), "--run-name", "killed"],
                             cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        # the bench, its `sciproto train`, and the run's env, policy and learner servers
        while len(running := processes_naming(str(tmp_path))) < 5 or not (tmp_path / "killed" / "learner.log").exists():
            assert bench.poll() is None, "the bench exited before its run started its servers"
            assert time.monotonic() < deadline, f"the run's servers did not all start within 240 s: {running}"
            time.sleep(0.5)
        os.kill(bench.pid, signal.SIGKILL)
        bench.wait(timeout=30)
        deadline = time.monotonic() + 60
        while left := processes_naming(str(tmp_path)):
            assert time.monotonic() < deadline, f"outlived the bench by 60 s: {left}"
            time.sleep(0.5)
    finally:
        for pid in [bench.pid, *processes_naming(str(tmp_path))]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_the_screening_replay_counts_every_probe_of_a_group(tmp_path: Path) -> None:
    # Group a: rewards 1, 1, 0, 0 of 10 tokens each; group b: all 0. A probe of 2 samples differs in
    # 4 of a's 6 pairs (then all 40 tokens are generated) and agrees in 2 (20 tokens); b's probe
    # always agrees (20 tokens). A group of 3 samples is cut short by a failure and left out.
    bench = load_bench("screening")
    rows = [("a", i, float(i < 2)) for i in range(4)] + [("b", i, 0.0) for i in range(4)]
    rows += [("c", i, 1.0) for i in range(3)]
    (tmp_path / "rollouts.jsonl").write_text("".join(json.dumps({
        "rollout_id": f"t/s/{g}/{i}", "group_id": f"t/s/{g}", "env": "t", "split": "s", "index": ord(g),
        "sample": i, "status": "SCORED", "reward": reward, "tokens": {"prompt": 5, "completion": 10},
    }) + "\n" for g, i, reward in rows))
    groups = bench.groups_of([tmp_path])
    assert sorted(len(g) for g in groups) == [4, 4]
    probe = bench.replay(groups, 2)
    assert probe["tokens"] == round((4 * 40 + 2 * 20) / 6 + 20)
    assert probe["signal_groups"] == round(4 / 6, 1)
    assert probe["signal_groups_lost"] == round(2 / 6, 1)
    assert bench.replay(groups, 3)["signal_groups"] == 1.0  # any 3 of 1, 1, 0, 0 differ


@pytest.mark.slow
def test_the_real_model_bench_evaluates_on_the_env_of_its_config(tmp_path: Path) -> None:
    """`--config` names any train config: the held-out evaluation runs on that config's env (the
    demo's toy env here, with its tiny model), not on gsm8k's."""
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, "bench/real_model.py", "--config", "demo", "--seconds", "15", "--limit", "3",
                           "--curve-every", "0", "--runs-dir", str(tmp_path), "--output", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["eval_tasks"].startswith("toy:test"), result["eval_tasks"]
    assert result["base"]["tasks"] == result["trained"]["tasks"] == 3


def test_the_real_model_bench_refuses_eval_tasks_without_a_split() -> None:
    done = subprocess.run([sys.executable, "bench/real_model.py", "--eval-tasks", "toytest", "--limit", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode != 0
    assert "--eval-tasks 'toytest' must look like ENV:SPLIT" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]


def test_the_revisit_bench_resumes_copies_of_one_run_and_counts_only_what_each_arm_did(tmp_path: Path) -> None:
    from clients.train.task_stats import TaskStats, TaskStatsFile
    from sciproto.client.rollouts import RolloutRecord, RolloutStatus
    from sciproto.rundir import LEARNER_STATE_FILE, MANIFEST_FILE, TASK_STATS_FILE, checkpoint_dir

    bench = load_bench("task_revisits")
    source = tmp_path / "source"
    for step in (10, 20):
        folder = checkpoint_dir(source, step)
        folder.mkdir(parents=True)
        (folder / MANIFEST_FILE).write_text("{}")
        (folder / LEARNER_STATE_FILE).write_text(json.dumps({"step": step}))
    (source / "config.yaml").write_text("run: {name: x}\n")
    (source / "rollouts.jsonl").write_text("{}\n")
    stats = TaskStats()
    stats.revisited, stats.revisits_mixed = 5, 1
    TaskStatsFile(source, checkpoint_every=10).save(stats, 20)

    arm = tmp_path / "arms" / "promising" / "run"
    bench.prepare(source, arm)
    # The latest checkpoint only, its files shared (hard links), and nothing the resumed run writes.
    assert sorted(p.name for p in (arm / "checkpoints").iterdir()) == ["step_00000020"]
    copied = arm / "checkpoints" / "step_00000020" / LEARNER_STATE_FILE
    assert copied.stat().st_ino == (source / "checkpoints" / "step_00000020" / LEARNER_STATE_FILE).stat().st_ino
    assert sorted(p.name for p in arm.iterdir()) == ["checkpoints", "config.yaml", TASK_STATS_FILE]

    # The resumed run's summary counts revisits since the start of the run it resumed.
    (arm / "summary.json").write_text(json.dumps({
        "groups_generated": 40, "groups_refused": {"no_signal": 30}, "tokens_per_s": 150.0, "stopped_by": "budget",
        "task_stats": {"revisited": 25, "revisits_mixed": 9}}))
    (arm / "metrics.jsonl").write_text('{"step": 21}\n{"step": 22}\n')
    # Three groups of task 4 (two samples each) and one of task 7.
    (arm / "rollouts.jsonl").write_text("".join(RolloutRecord(
        rollout_id=f"toy/train/{index}#{epoch}/{sample}", group_id=f"toy/train/{index}#{epoch}", env="toy",
        split="train", index=index, sample=sample, status=RolloutStatus.SCORED).to_json_line()
        for index, epoch in [(4, 0), (4, 1), (4, 2), (7, 0)] for sample in range(2)))
    before = TaskStats()
    assert bench.restore_task_stats(before, source) == 20
    assert bench.figures(arm, before) == {
        "groups_generated": 40, "groups_no_signal": 30, "groups_with_signal_per_100": 25.0, "grpo_steps": 2,
        "revisits": 20, "revisits_mixed": 8, "revisits_mixed_frac": 0.4, "tasks": 2, "most_groups_of_one_task": 3,
        "tokens_per_s": 150.0,
        "stopped_by": "budget"}
