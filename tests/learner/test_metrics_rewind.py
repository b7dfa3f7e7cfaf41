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


def test_truncate_cuts_at_a_checkpoints_position_and_drops_a_torn_line(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path, MetricsConfig(plot_every=1000))
    logger.log({"step": 1, "groups_consumed": 4})
    position = logger.position()  # what the checkpoint of step 1 records
    logger.log({"step": 2, "groups_consumed": 4})
    logger.close()
    with (tmp_path / METRICS_FILE).open("a", encoding="utf-8") as file:
        file.write('{"step": 3, "groups_con')  # a line the crash cut off

    resumed = MetricsLogger(tmp_path, MetricsConfig(plot_every=1000))
    assert resumed.truncate(position) == 2
    resumed.log({"step": 2, "groups_consumed": 4})
    assert resumed.truncate(resumed.position()) == 0
    resumed.close()
    lines = [json.loads(line) for line in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
