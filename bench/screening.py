"""What screening a group before growing it would have saved, replayed on a run's own groups.

The design: a task's group starts with `k` of its `n` samples and grows to `n` only when those `k`
differ in reward; when they agree the task is dropped after `k` samples (GRPO could not learn from
an all-equal group, and the k samples predict the rest). Every sample of a group is drawn
independently from the same policy, so any k of a finished group of n are a draw of that probe,
and each figure below is exact over all C(n, k) subsets of each group:

    cost(subset)   = tokens(subset) + [subset differs] * tokens(the other n - k)
    signal(subset) = [subset differs]          (then the grown group differs too)
    lost           = [group differs] - signal  (signal the probe would have thrown away)

Reported per k, against generating every group in full: completion tokens spent, groups with
signal, and their ratio (signal groups per 1,000 tokens) over the full ratio: above 1 the probe
teaches more per token generated. `no_signal_tokens_frac` is the share of the completion tokens
that went to groups without signal.
Output JSON: {"groups", "samples", "full": {...}, "probe": {"k": {...}}}.
Usage: python bench/screening.py RUN_DIR_OR_ROLLOUTS_JSONL [...]
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections import defaultdict
from pathlib import Path

from sciproto.client.rollouts import RolloutStatus, read_rollouts


def groups_of(paths: list[Path]) -> list[list[tuple[float, int]]]:
    """(reward, completion tokens) of each scored sample, per group of the same size."""
    groups: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for path in paths:
        rollouts = path / "rollouts.jsonl" if path.is_dir() else path
        for record in read_rollouts(rollouts):
            if record.status is RolloutStatus.SCORED:
                groups[f"{path}:{record.group_id}"].append((record.reward, record.tokens.completion))
    sizes = [len(g) for g in groups.values()]
    if not sizes:
        return []
    n = max(set(sizes), key=sizes.count)  # the run's group size; groups cut short by failures are left out
    return [g for g in groups.values() if len(g) == n]


def differs(samples: tuple[tuple[float, int], ...] | list[tuple[float, int]]) -> bool:
    return len({reward for reward, _ in samples}) > 1


def replay(groups: list[list[tuple[float, int]]], k: int) -> dict:
    tokens = signal = lost = 0.0
    for group in groups:
        subsets = list(itertools.combinations(range(len(group)), k))
        for subset in subsets:
            probe = [group[i] for i in subset]
            grows = differs(probe)
            rest = sum(t for i, (_, t) in enumerate(group) if i not in subset)
            spent = sum(t for _, t in probe) + (rest if grows else 0)
            tokens += spent / len(subsets)
            signal += grows / len(subsets)
            lost += (differs(group) and not grows) / len(subsets)
    return {"tokens": round(tokens), "signal_groups": round(signal, 1), "signal_groups_lost": round(lost, 1),
            "signal_per_1000_tokens": round(1000 * signal / tokens, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="Run directories (their rollouts.jsonl) or rollout files")
    args = parser.parse_args()
    groups = groups_of(args.runs)
    if not groups:
        raise SystemExit("screening: no complete scored group in " + ", ".join(map(str, args.runs)))
    n = len(groups[0])
    tokens = sum(t for g in groups for _, t in g)
    signal = sum(differs(g) for g in groups)
    wasted = sum(t for g in groups if not differs(g) for _, t in g)
    full = {"tokens": tokens, "signal_groups": signal, "no_signal_groups_frac": round(1 - signal / len(groups), 3),
            "no_signal_tokens_frac": round(wasted / tokens, 3),
            "signal_per_1000_tokens": round(1000 * signal / tokens, 3)}
    probe = {}
    for k in range(2, n):
        figures = replay(groups, k)
        figures["vs_full"] = round(figures["signal_per_1000_tokens"] / full["signal_per_1000_tokens"], 3)
        probe[str(k)] = figures
    print(json.dumps({"groups": len(groups), "samples": n, "full": full, "probe": probe}, indent=2))


if __name__ == "__main__":
    main()
