"""Expected answers of the shipped tasks, read from the data files: the servers never send them
(task summaries reach the agent, so they hold the question only)."""

from __future__ import annotations

import json
from functools import cache

from env_servers.envs import gsm8k, notebook


@cache
def _gsm8k_rows(split: str) -> list[dict[str, str]]:
    file_name, _ = gsm8k.SPLITS[split]
    return [json.loads(line) for line in (gsm8k.DATA_DIR / file_name).read_text().splitlines()]


@cache
def _notebook_tasks(split: str) -> list[dict[str, str]]:
    lines = (notebook.DATA_DIR / "tasks.jsonl").read_text().splitlines()
    return [task for task in map(json.loads, lines) if task["split"] == split]


def expected_answer(env: str, split: str, index: int) -> str:
    """The answer of task `index` of `split` as a submission would give it (gsm8k: the number)."""
    if env == "gsm8k":
        return _gsm8k_rows(split)[index]["answer"].split("#### ")[-1]
    if env == "notebook":
        return _notebook_tasks(split)[index]["answer"]
    raise ValueError(f"no shipped answers for environment {env!r}")
