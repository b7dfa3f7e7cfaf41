"""`sciproto serve policy`: load the model, start PolicyService, serve until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
from collections.abc import Sequence
from types import ModuleType

import torch

from policy_server.backends.base import PolicyBackend
from policy_server.config import PolicyServerConfig
from policy_server.service import PolicyServicer, PromptTokenizer, register
from policy_server.tokenizing import longest_token_chars
from sciproto.auth import Authenticator
from sciproto.config import ConfigError, load_component_config
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


def _optional_backend(name: str) -> ModuleType:
    """The module of a backend other than `transformers`: these pull in heavy optional packages, so
    each is imported only when chosen. Each offers `build_backend(config: PolicyServerConfig) ->
    PolicyBackend` whose backend also has `prompt_token_ids(request) -> list[int]`."""
    if name == "vllm":
        from policy_server.backends import vllm_backend

        return vllm_backend
    if name == "openai":
        from policy_server.backends import openai_backend

        return openai_backend
    raise ConfigError(f"unknown backend {name!r}: use transformers, vllm or openai")


def load_policy_config(config: str | None, overrides: Sequence[str] = ()) -> PolicyServerConfig:
    """A policy config file, or the `policy:` section of a file that configures several components."""
    return load_component_config(PolicyServerConfig, config, overrides, SECTION)


def build_backend(config: PolicyServerConfig) -> tuple[PolicyBackend, PromptTokenizer]:
    """The configured backend, and how its prompts are turned into token ids."""
    if config.backend == "transformers":
        from policy_server.backends.transformers_backend import TransformersBackend
        from policy_server.prompts import prompt_token_ids
        from sciproto.models import load_model

        options = config.transformers
        loaded = load_model(config.model, getattr(torch, config.dtype), config.seed, options.device)
        backend = TransformersBackend(loaded, batch_window_s=options.batch_window_s,
                                      max_batch_rows=options.max_batch_rows, stream_interval=options.stream_interval,
                                      collective=config.weights.collective)
        tokenize = functools.partial(prompt_token_ids, loaded.tokenizer, stop_token_ids=loaded.stop_token_ids)
        tokenize.tokenizer = loaded.tokenizer  # type: ignore[attr-defined]  # read by `start` for its length bound
        return backend, tokenize
    try:
        module = _optional_backend(config.backend)
    except ImportError as error:
        raise ConfigError(f"backend {config.backend!r} is not available here ({error}); install the "
                          f"sciproto[{config.backend}] extra or use backend=transformers") from error
    backend = module.build_backend(config)
    return backend, backend.prompt_token_ids


async def start(config: PolicyServerConfig, authenticator: Authenticator | None) -> RunningServer:
    """Load the model and start serving it; returns at once (the caller stops the server).
    `serve` waits for a signal around it; a cluster engine's actor calls it directly."""
    backend, tokenize = build_backend(config)
    tokenizer = getattr(tokenize, "tokenizer", None) or getattr(backend, "_tokenizer", None)
    servicer = PolicyServicer(backend, tokenize, config,
                              longest_token_chars(tokenizer) if tokenizer is not None else None)
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
