"""Configuration of the environment server: which environments it hosts, with what options, and
the limits of its episode registry."""

from __future__ import annotations

from typing import Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from env_servers.catalog import builtin_names
from sciproto.auth import AuthConfig
from sciproto.server import ServerConfig
from sciproto.tracing import TracingConfig


class EnvServerConfig(BaseModel):
    """`sciproto serve env` settings; load with `sciproto.config.load_config(EnvServerConfig, ...)`."""

    # Option values are text (as catalog sources take them); YAML numbers become strings.
    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True)

    server: ServerConfig = Field(default_factory=ServerConfig)
    envs: list[str] = Field(default_factory=builtin_names, min_length=1,
                            description="Environments to host: built-in names or names Aviary knows")
    imports: list[str] = Field(
        default_factory=list, description="Python modules to import first (module names, or paths of .py files"
        " relative to the working directory): each may register environments of its own"
        " (env_servers.catalog.register) for envs to name")
    env_options: dict[str, dict[str, str | list[str]]] = Field(
        default_factory=dict, description="Per-environment source options, by environment name (text, or a"
        " list of names where the option takes one, such as the notebook's preload)")
    max_live_episodes: int = Field(1024, gt=0, description="Reset beyond this many open episodes is refused")
    idle_ttl_s: float = Field(600.0, gt=0, description="An episode untouched this long is closed")
    step_timeout_s: float = Field(120.0, gt=0, description="A Step (or Reset) running longer fails the episode")
    heartbeat_interval_s: float = Field(5.0, gt=0, description="Session heartbeat period while an operation runs")
    session_max_in_flight: int = Field(256, gt=0, description="Operations one Session stream may have running;"
                                       " more are answered in-band with RESOURCE_EXHAUSTED and RetryInfo")
    idempotency_cache_size: int = Field(8192, gt=0, description="Results kept for retried request_ids")
    retry_after_s: float = Field(1.0, gt=0, description="RetryInfo delay sent with a refused Reset")
    auth: AuthConfig = Field(default_factory=AuthConfig, description="Bearer tokens and roles; off unless set")
    tracing: TracingConfig = Field(default_factory=TracingConfig, description="Span exporter; off by default")

    @model_validator(mode="after")
    def _options_name_hosted_envs(self) -> Self:
        duplicates = sorted({name for name in self.envs if self.envs.count(name) > 1})
        if duplicates:
            raise ValueError(f"envs lists {duplicates} more than once; name each environment once")
        strays = sorted(self.env_options.keys() - set(self.envs))
        if strays:
            raise ValueError(f"env_options given for {strays}, which are not in envs {self.envs};"
                             " add them to envs or remove their options")
        return self
