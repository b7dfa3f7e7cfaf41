"""`sciproto serve env`: load the configuration, load the environments, serve until a signal."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import sys
from collections.abc import Mapping

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before anything imports aviary


from env_servers import scratch
from env_servers.catalog import EnvironmentSource, import_modules, load_source
from env_servers.config import EnvServerConfig
from env_servers.sandbox import SandboxUnavailable
from env_servers.service import EnvironmentService
from sciproto.auth import Authenticator
from sciproto.config import ConfigError, load_component_config
from sciproto.pb import ENV_SERVICE, env_grpc
from sciproto.server import (
    RunningServer,
    Service,
    announce_port,
    serve_until_signalled,
    start_server,
)
from sciproto.tracing import server_interceptors, setup_tracing, shutdown_tracing

log = logging.getLogger("env_servers.app")

SECTION = "env"  # in a config file shared by every component, the env server reads this section


def load_settings(config: str | None, overrides: list[str]) -> EnvServerConfig:
    """The configuration from `config` (a whole file for this server, or the `env` section of a
    file for every component) and `key.path=value` overrides."""
    return load_component_config(EnvServerConfig, config, overrides, SECTION)


def load_sources(settings: EnvServerConfig) -> dict[str, EnvironmentSource]:
    try:
        import_modules(settings.imports)
    except ValueError as error:
        raise ConfigError(str(error)) from error
    sources = {}
    for name in settings.envs:
        try:
            sources[name] = load_source(name, settings.env_options.get(name, {}))
        except (ValueError, FileNotFoundError, SandboxUnavailable) as error:
            raise ConfigError(f"environment {name!r} cannot be hosted: {error}") from error
    return sources


async def start(settings: EnvServerConfig, sources: Mapping[str, EnvironmentSource],
                authenticator: Authenticator | None) -> RunningServer:
    """Load the service and start serving it; returns at once (the caller stops the server).
    `serve` waits for a signal around it; a cluster engine's actor calls it directly."""
    # Directories of env servers that were killed (their clean-up never ran); never a live one's.
    scratch.remove_orphans()
    service = EnvironmentService(settings, sources)
    # Everything imported so far (Aviary, litellm, pandas) lives as long as the process: keep it
    # out of the collector's full passes, which otherwise walk it while serving and at exit.
    gc.freeze()
    service.start()
    running = await start_server(
        settings.server, [Service(ENV_SERVICE, service, env_grpc.add_EnvironmentServiceServicer_to_server)],
        interceptors=server_interceptors(settings.tracing), auth=authenticator)
    log.info("hosting %s on %s:%d", ", ".join(sources), settings.server.host, running.port)
    return running


async def serve(settings: EnvServerConfig, sources: Mapping[str, EnvironmentSource],
                authenticator: Authenticator | None) -> None:
    setup_tracing(settings.tracing, "sciproto-env")
    try:
        running = await start(settings, sources, authenticator)
        await serve_until_signalled(running, on_ready=lambda port: announce_port("env", port))
    finally:
        shutdown_tracing()


def main(config: str | None, overrides: list[str]) -> None:
    try:
        settings = load_settings(config, overrides)
        # Tokens are read before the environments load, so a missing one fails at once.
        authenticator = settings.auth.load()
        sources = load_sources(settings)
    except ConfigError as error:
        print(f"sciproto serve env: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    asyncio.run(serve(settings, sources, authenticator))
