"""The optional backends' settings (`policy.vllm`, `policy.openai`) are typed parts of the policy
server's configuration: checked when it loads, and written out in the configuration reference."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from policy_server.app import build_backend, load_policy_config
from sciproto.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_backend_settings_are_checked_when_the_config_loads() -> None:
    config = load_policy_config(None, ["backend=openai", "openai.base_url=http://127.0.0.1:1/v1",
                                       "vllm.kv_cache_bytes=134217728"])
    assert config.openai is not None and config.openai.base_url == "http://127.0.0.1:1/v1"
    assert config.vllm.kv_cache_bytes == 134217728
    with pytest.raises((ValidationError, ConfigError), match="kv_cache_byte"):
        load_policy_config(None, ["vllm.kv_cache_byte=1"])  # a misspelt key is refused, not passed on


def test_the_openai_backend_without_its_endpoint_says_what_to_set() -> None:
    with pytest.raises(ConfigError, match="openai.base_url"):
        build_backend(load_policy_config(None, ["backend=openai"]))


def test_the_configuration_reference_describes_them() -> None:
    sys.path.insert(0, str(ROOT / "scripts" / "docs"))
    try:
        from config_reference import configuration_reference
    finally:
        sys.path.remove(str(ROOT / "scripts" / "docs"))
    reference = configuration_reference()
    assert "| `policy.vllm.kv_cache_bytes` | integer | `1073741824` | Size of the KV cache" in reference
    assert "| `policy.openai.base_url` | string | required | Endpoint root" in reference


def test_the_configuration_and_the_plug_ins_load_without_torch_or_vllm() -> None:
    """What options.py and registry.py promise: a process that only reads a policy configuration
    or picks a plug-in imports neither torch nor vLLM."""
    import subprocess

    code = ("import sys, policy_server.config, policy_server.backends.registry as r; r.backend_plugin('vllm'); "
            "print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))")
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert shown.stdout.strip() == "[]", shown.stdout + shown.stderr
