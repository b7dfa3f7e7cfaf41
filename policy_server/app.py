"""`sciproto serve policy`: load the model, start PolicyService, serve until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from policy_server.backends.base import PolicyBackend
from policy_server.backends.registry import backend_plugin
from policy_server.config import PolicyServerConfig
from policy_server.service import PolicyServicer, PromptTokenizer, register
from policy_server.tokenizing import longest_token_chars
from sciproto.auth import Authenticator
from sciproto.config import ConfigError, load_component_config
from sciproto.hardware import auto_dtype
from sciproto.pb import POLICY_SERVICE
from sciproto.server import (
    RunningServer,
    Service,
    announce_port,
    serve_until_signalled,
    start_server,
)
from sciproto.tracing import server_interceptors, setup_tracing, shutdown_tracing

log = logging.getLogger("policy_server")

SECTION = "policy"  # in a config file shared by every component, the policy server reads this section


def load_policy_config(config: str | None, overrides: Sequence[str] = ()) -> PolicyServerConfig:
    """A policy config file, or the `policy:` section of a file that configures several components."""
    return load_component_config(PolicyServerConfig, config, overrides, SECTION)


def resolve_dtype(config: PolicyServerConfig) -> PolicyServerConfig:
    """`dtype: auto` made concrete for the device this server computes on (sciproto.hardware):
    transformers' configured device; vllm's GPU where there is one, else the CPU. The openai
    backend relays another server's model and has no dtype of its own: left as it is."""
    if config.dtype != "auto" or config.backend == "openai":
        return config
    if config.backend == "transformers":
        device = config.transformers.device
    else:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype, reason = auto_dtype(device)
    log.info("dtype auto: serving %s (%s)", dtype, reason)
    return config.model_copy(update={"dtype": dtype})


def build_backend(config: PolicyServerConfig) -> tuple[PolicyBackend, PromptTokenizer]:
    """The configured backend (its plug-in's factory, policy_server.backends.registry), and how its
    prompts are turned into token ids."""
    config = resolve_dtype(config)
    plugin = backend_plugin(config.backend)
    try:
        factory = plugin.load()
    except ImportError as error:
        raise ConfigError(f"backend {config.backend!r} is not available here ({error}); install the "
                          f"sciproto[{config.backend}] extra or use backend=transformers") from error
    backend = factory(config)
    return backend, backend.prompt_token_ids  # type: ignore[attr-defined]


async def start(config: PolicyServerConfig, authenticator: Authenticator | None) -> RunningServer:
    """Load the model and start serving it; returns at once (the caller stops the server).
    `serve` waits for a signal around it; a cluster engine's actor calls it directly."""
    backend, tokenize = build_backend(config)
    tokenizer = backend.tokenizer  # type: ignore[attr-defined]  # None where the prompt is rendered elsewhere
    servicer = PolicyServicer(backend, tokenize, config,
                              longest_token_chars(tokenizer) if tokenizer is not None else None,
                              capabilities=backend_plugin(config.backend).capabilities)
    service = Service(POLICY_SERVICE, servicer, register)
    running = await start_server(config.server, [service], interceptors=server_interceptors(config.tracing),
                                 auth=authenticator)
    servicer.health = running.health
    info = backend.info()
    log.info("serving %s (%s, %s) on %s:%d", info.model, info.backend, info.dtype, config.server.host,
             running.port)
    return running


async def serve(config: PolicyServerConfig, authenticator: Authenticator | None) -> None:
    setup_tracing(config.tracing, "sciproto-policy")
    try:
        running = await start(config, authenticator)
        await serve_until_signalled(running, on_ready=lambda port: announce_port("policy", port))
    finally:
        shutdown_tracing()


def main(config: str | None, overrides: list[str]) -> None:
    try:
        settings = load_policy_config(config, overrides)
        # Tokens are read before the model loads, so a missing one fails at once.
        authenticator = settings.auth.load()
    except ConfigError as error:
        print(f"sciproto serve policy: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    asyncio.run(serve(settings, authenticator))
