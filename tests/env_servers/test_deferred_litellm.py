"""Importing the env server (and Aviary through it) leaves litellm unimported until it is used, and
every use still works: `import litellm` attributes, and Aviary's LLM grading entry point."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
import env_servers.app
from env_servers.catalog import load_source
load_source("gsm8k"); load_source("notebook", {"sandbox": "none"})
print("loaded_before_use", "litellm.main" in sys.modules)
import aviary.utils
import litellm
print("completion_is_litellms", litellm.completion.__module__.startswith("litellm"))
print("replaced", type(sys.modules["litellm"]).__name__ == "module")
from aviary.envs.notebook import utils as notebook_utils
print("notebook_sees_it", notebook_utils.litellm.completion is litellm.completion)
import inspect
print("grading_entry_point", inspect.iscoroutinefunction(aviary.utils.acompletion))
"""


def test_litellm_loads_on_first_use_only_and_then_serves_every_importer() -> None:
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    facts = dict(line.split() for line in result.stdout.splitlines())
    assert facts == {"loaded_before_use": "False", "completion_is_litellms": "True", "replaced": "True",
                     "notebook_sees_it": "True", "grading_entry_point": "True"}, result.stdout
    assert "Exception ignored" not in result.stderr, result.stderr[-3000:]
