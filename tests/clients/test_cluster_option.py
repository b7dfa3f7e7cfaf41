"""`sciproto train --cluster`: a word on what to install when Ray is missing, and on a bad value;
one or two lines and a non-zero exit, before any server starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# The CLI in a Python that cannot import Ray (as where the sciproto[ray] extra is not installed).
WITHOUT_RAY = "import sys; sys.modules['ray'] = None; from clients.cli import main; main(sys.argv[1:])"


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", WITHOUT_RAY, "train", "--set", f"run.dir={tmp_path}", *args],
                          check=False, capture_output=True, text=True, timeout=120)


def test_cluster_ray_without_ray_says_what_to_install(tmp_path: Path) -> None:
    result = run(tmp_path, "--cluster", "ray")
    assert result.returncode != 0
    assert "pip install 'sciproto[ray]'" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not list(tmp_path.glob("*/*.log"))  # no server started


def test_an_unknown_cluster_is_refused(tmp_path: Path) -> None:
    result = run(tmp_path, "--cluster", "slurm")
    assert result.returncode == 2
    assert "--cluster 'slurm': use local or ray" in result.stderr, result.stderr


def test_plaintext_servers_on_a_reachable_node_address_are_refused_before_any_actor_starts() -> None:
    import pytest

    from clients.train import load_train_config
    from clients.train.ray_engine import check_servers_may_listen
    from sciproto.config import ConfigError

    with pytest.raises(ConfigError) as refused:
        check_servers_may_listen(load_train_config("demo"), "192.0.2.2")
    assert "--set env.server.allow_insecure_remote=true" in str(refused.value)
    check_servers_may_listen(load_train_config("demo"), "127.0.0.1")  # loopback: plaintext is fine
    opted_in = [f"{role}.server.allow_insecure_remote=true" for role in ("env", "policy", "learner")]
    check_servers_may_listen(load_train_config("demo", opted_in), "192.0.2.2")


def test_an_actor_that_could_not_start_reports_what_its_config_check_says() -> None:
    import pytest
    from pydantic import ValidationError

    from clients.train.ray_actor import one_line
    from sciproto.server import ServerConfig

    with pytest.raises(ValidationError) as caught:
        ServerConfig(host="192.0.2.2")
    assert "refusing to serve plaintext on '192.0.2.2'" in one_line(caught.value)


def test_learner_ranks_are_neither_replicas_nor_restarted_one_by_one() -> None:
    import pytest
    from pydantic import ValidationError

    from clients.train.cluster import ClusterSettings

    with pytest.raises(ValidationError, match="for data parallelism set cluster.learner.ranks"):
        ClusterSettings.model_validate({"learner": {"replicas": 2}})
    with pytest.raises(ValidationError, match="set cluster.learner.max_restarts 0"):
        ClusterSettings.model_validate({"learner": {"ranks": 2, "max_restarts": 1}})
    assert ClusterSettings.model_validate({"learner": {"ranks": 2}}).learner.ranks == 2
