"""The CLI surface, config loading and the error model's round trip."""

from __future__ import annotations

import subprocess

import grpc
import pytest
from pydantic import BaseModel

from sciproto.config import ConfigError, load_config
from sciproto.errors import Reason, ResourceExhausted, from_status, to_status
from sciproto.processes import sciproto_command


def test_help_lists_every_subcommand() -> None:
    result = subprocess.run(sciproto_command("--help"), check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    for command in ("serve", "describe", "collect", "train", "view"):
        assert command in result.stdout
    serve = subprocess.run(sciproto_command("serve", "--help"), check=False, capture_output=True, text=True, timeout=60)
    for component in ("env", "policy", "learner"):
        assert component in serve.stdout


class Inner(BaseModel):
    port: int = 1
    names: list[str] = []


class Outer(BaseModel):
    inner: Inner = Inner()
    rate: float = 0.5


def test_yaml_with_overrides(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("inner:\n  port: 7\nrate: 0.1\n")
    config = load_config(Outer, path, ["inner.names=[a,b]", "rate=3e-4"])
    assert config == Outer(inner=Inner(port=7, names=["a", "b"]), rate=3e-4)


def test_config_errors_say_where(tmp_path) -> None:
    with pytest.raises(ConfigError, match="key.path=value"):
        load_config(Outer, None, ["no-equals-sign"])
    with pytest.raises(ConfigError, match="inner.port"):
        load_config(Outer, None, ["inner.port=notanint"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(Outer, tmp_path / "missing.yaml")


def test_error_round_trip_keeps_reason_and_retry_delay() -> None:
    error = ResourceExhausted("too many episodes", Reason.TOO_MANY_EPISODES, retry_after_s=1.5,
                              metadata={"limit": "4"})
    back = from_status(to_status(error))
    assert isinstance(back, ResourceExhausted)
    assert back.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (back.reason, back.retry_after_s, back.metadata) == (Reason.TOO_MANY_EPISODES, 1.5, {"limit": "4"})
