"""`sciproto train`'s one config: what it derives for each component, and what it refuses."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from clients.train import load_train_config
from sciproto.config import ConfigError


@pytest.mark.parametrize(("sampled_at", "trained_at"), [(0.7, 0.7), (1.0, 1.0), (0.0, 1.0)])
def test_the_learner_trains_the_policy_at_the_rollouts_sampling_temperature(sampled_at: float,
                                                                            trained_at: float) -> None:
    config = load_train_config("demo", [f"rollout.sampling.temperature={sampled_at}"])
    assert config.learner.grpo.temperature == trained_at  # greedy rollouts report the T = 1 logprobs


def test_a_learner_temperature_other_than_the_sampling_one_is_refused() -> None:
    with pytest.raises(ConfigError, match="learner.grpo.temperature 0.5 differs from rollout.sampling.temperature"):
        load_train_config("demo", ["rollout.sampling.temperature=0.7", "learner.grpo.temperature=0.5"])
    same = load_train_config("demo", ["rollout.sampling.temperature=0.7", "learner.grpo.temperature=0.7"])
    assert same.learner.grpo.temperature == 0.7


def test_reset_options_are_sent_with_every_reset_beside_the_observation() -> None:
    config = load_train_config("demo", ["env.envs=[notebook]", "rollout.tasks=notebook:train", "rollout.grouping=step",
                                        "rollout.observation=state", "rollout.reset_options.action=code",
                                        "rollout.reset_options.cell_reward=0.1"])
    assert config.rollout.options == {"action": "code", "cell_reward": "0.1", "observation": "state"}
    with pytest.raises(ConfigError, match="rollout.observation state needs rollout.grouping step"):
        load_train_config("demo", ["rollout.reset_options.observation=state"])


def test_a_shared_policy_server_takes_only_an_adapter_and_never_reaches_the_started_servers_section() -> None:
    with pytest.raises(ConfigError, match="a shared policy server takes each run's LoRA adapter"):
        load_train_config("demo", ["policy.address=127.0.0.1:50052"])
    with pytest.raises(ConfigError, match="cluster.engine ray starts its own"):
        load_train_config("demo", ["policy.address=127.0.0.1:50052", "learner.lora.name=a", "cluster.engine=ray"])
    config = load_train_config("demo", ["policy.address=127.0.0.1:50052", "learner.lora.name=run-a"])
    assert config.policy.address == "127.0.0.1:50052"
    # The `policy:` section a started policy server would read has no such key (it refuses unknown keys).
    assert "address" not in config.model_dump(mode="json")["policy"]


def test_a_lora_runs_vllm_server_holds_exactly_its_adapter_and_a_plain_vllm_server_none() -> None:
    # vLLM's CPU LoRA kernels slow every request by the largest rank the engine takes, so a vllm
    # server takes adapters only when told, and a LoRA run tells its own server its adapter's size.
    plain = load_train_config("demo", ["policy.backend=vllm"])
    assert plain.policy.adapters.held("vllm") == 0
    assert load_train_config("demo", []).policy.adapters.held("transformers") == 4
    sized = load_train_config("demo", ["policy.backend=vllm", "learner.lora.rank=16"])
    assert (sized.policy.adapters.max_adapters, sized.policy.adapters.max_rank) == (1, 16)
    with pytest.raises(ConfigError, match="policy.adapters.max_adapters is 0"):
        load_train_config("demo", ["learner.lora.rank=8", "policy.adapters.max_adapters=0"])
    with pytest.raises(ConfigError, match="learner.lora.rank 32 is above policy.adapters.max_rank 16"):
        load_train_config("demo", ["learner.lora.rank=32", "policy.adapters.max_rank=16"])


def test_a_bad_config_is_refused_before_torch_loads(tmp_path: Path) -> None:
    """Reading and checking the config needs no torch (seconds of imports): the CLI, in a Python
    where importing torch fails, still names the bad key and exits 1."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("learner:\n  batch_groups: 0\n  lora:\n    name: a\n")
    without_torch = "import sys; sys.modules['torch'] = None; from clients.cli import main; main(sys.argv[1:])"
    result = subprocess.run([sys.executable, "-c", without_torch, "train", "--config", str(bad)],
                            check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert "learner.batch_groups" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
