"""A learner that resumes at step S drops the metrics lines of later steps, which it trains again."""

from __future__ import annotations

import json
from pathlib import Path

from learner.metrics import METRICS_FILE, MetricsConfig, MetricsLogger


def test_rewind_drops_the_steps_after_the_resumed_one_and_appends_after_them(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path, MetricsConfig(plot_every=1000))
    for step in (1, 2, 3):
        logger.log({"step": step, "groups_consumed": 4})
    logger.close()

    resumed = MetricsLogger(tmp_path, MetricsConfig(plot_every=1000))
    assert resumed.rewind(2) == 1
    resumed.log({"step": 3, "groups_consumed": 4})
    resumed.close()
    steps = [json.loads(line)["step"] for line in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert sum(json.loads(line)["groups_consumed"]
               for line in (tmp_path / METRICS_FILE).read_text().splitlines()) == 12
