"""OpenTelemetry tracing shared by every sciproto process.

One episode is one trace across three processes: the rollout client opens
the episode span; env and policy servers add their spans under it. The trace
context travels in two places, as the contract says: gRPC metadata
(`traceparent`/`tracestate`, W3C Trace Context) and the `trace_context` field
of every request. Metadata covers a whole RPC; the field is per message, which
is what a long stream (Session, TrainStep) needs, since each step on it
belongs to its own episode.

Server process:

    setup_tracing(config.tracing, "sciproto-env")
    running = await start_server(config.server, services, interceptors=server_interceptors(config.tracing))
    ...
    async for request in request_iterator:              # inside a Session stream
        with span_for_request(span_name(Operation.ENV_STEP, env), context, request.step.trace_context,
                              **{Attr.ENV_NAME: env, Attr.EPISODE_ID: episode_id}):
            ...
    shutdown_tracing()

Client process:

    setup_tracing(config.tracing, "sciproto-rollout")
    channel = make_channel(target, interceptors=client_interceptors(config.tracing))
    with start_span(span_name(Operation.INVOKE_AGENT, env), **{Attr.TASK_ID: task_id}):
        await stub.Step(StepRequest(..., trace_context=current_trace_context()),
                        metadata=inject_metadata())

With exporter "none" (the default) nothing is installed: no interceptors, and
`start_span`/`span_for_request` return OTel's no-op span without touching
the context, so tracing costs nothing when it is off.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Final, Literal

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.instrumentation.grpc import (
    aio_client_interceptors,
    aio_server_interceptor,
    filters,
)
from opentelemetry.propagate import set_global_textmap
from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue
from pydantic import BaseModel, ConfigDict, Field, model_validator

from sciproto.pb import common_pb2
from sciproto.tracing_jsonl import JsonlSpanExporter
from sciproto.version import __version__

ExporterName = Literal["none", "console", "otlp", "jsonl"]


class TracingConfig(BaseModel):
    """Where a process sends its spans. The `tracing` section of every component's config."""

    model_config = ConfigDict(extra="forbid")

    exporter: ExporterName = Field("none", description="none: tracing off, at no cost")
    otlp_endpoint: str = Field("http://127.0.0.1:4317", description="OTLP/gRPC collector (exporter otlp); http:// means plaintext")
    jsonl_path: Path | None = Field(None, description="File the spans are appended to (exporter jsonl)")
    service_name: str | None = Field(None, description="Overrides the component's own name (service.name)")
    sample_ratio: float = Field(1.0, ge=0.0, le=1.0, description="Share of new traces recorded; children follow their parent")

    @model_validator(mode="after")
    def _jsonl_needs_a_path(self) -> TracingConfig:
        if self.exporter == "jsonl" and self.jsonl_path is None:
            raise ValueError("tracing exporter 'jsonl' needs a file: set tracing.jsonl_path=PATH")
        return self

    @property
    def enabled(self) -> bool:
        return self.exporter != "none"


class Attr:
    """Span attribute names: OpenTelemetry GenAI semantic conventions where they
    exist, `sciproto.*` for what they do not cover."""

    GEN_AI_OPERATION_NAME: Final = "gen_ai.operation.name"
    GEN_AI_PROVIDER_NAME: Final = "gen_ai.provider.name"
    GEN_AI_AGENT_NAME: Final = "gen_ai.agent.name"
    GEN_AI_REQUEST_MODEL: Final = "gen_ai.request.model"
    GEN_AI_RESPONSE_MODEL: Final = "gen_ai.response.model"
    GEN_AI_REQUEST_TEMPERATURE: Final = "gen_ai.request.temperature"
    GEN_AI_REQUEST_TOP_P: Final = "gen_ai.request.top_p"
    GEN_AI_REQUEST_MAX_TOKENS: Final = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_CHOICE_COUNT: Final = "gen_ai.request.choice.count"
    GEN_AI_USAGE_INPUT_TOKENS: Final = "gen_ai.usage.input_tokens"
    GEN_AI_USAGE_OUTPUT_TOKENS: Final = "gen_ai.usage.output_tokens"
    GEN_AI_RESPONSE_FINISH_REASONS: Final = "gen_ai.response.finish_reasons"
    GEN_AI_TOOL_NAME: Final = "gen_ai.tool.name"
    GEN_AI_TOOL_CALL_ID: Final = "gen_ai.tool.call.id"

    ENV_NAME: Final = "sciproto.env.name"
    TASK_ID: Final = "sciproto.task.id"
    SAMPLE_INDEX: Final = "sciproto.sample.index"
    EPISODE_ID: Final = "sciproto.episode.id"
    FORK_EPISODE_ID: Final = "sciproto.fork.episode.id"  # the episode a Fork opened
    REWARD_VALUE: Final = "sciproto.reward.value"
    REWARD_STATUS: Final = "sciproto.reward.status"
    POLICY_VERSION: Final = "sciproto.policy.version"


class Operation:
    """Values of `gen_ai.operation.name`, and sciproto's own operations."""

    INVOKE_AGENT: Final = "invoke_agent"  # one episode of the agent loop
    CHAT: Final = "chat"  # one Generate call
    EXECUTE_TOOL: Final = "execute_tool"  # one tool call run by the environment
    ENV_RESET: Final = "sciproto.env.reset"
    ENV_STEP: Final = "sciproto.env.step"
    ENV_VERIFY: Final = "sciproto.env.verify"
    ENV_CLOSE: Final = "sciproto.env.close"
    ENV_FORK: Final = "sciproto.env.fork"
    TRAIN_STEP: Final = "sciproto.learner.train_step"
    UPDATE_WEIGHTS: Final = "sciproto.policy.update_weights"


def span_name(operation: str, target: str | None = None) -> str:
    """`{operation} {target}`, as the GenAI conventions name spans:
    "chat tiny", "execute_tool python", "invoke_agent gsm8k"."""
    return f"{operation} {target}" if target else operation


# W3C Trace Context only: the propagation format of the contract.
_W3C = TraceContextTextMapPropagator()
# Health checks and reflection are plumbing, not work: they get no spans.
_TRACED_RPCS = filters.negate(filters.any_of(filters.service_prefix("grpc.health"),
                                             filters.service_prefix("grpc.reflection")))

_provider: TracerProvider | None = None
_global_provider_installed = False


def setup_tracing(config: TracingConfig, service_name: str) -> None:
    """Install a tracer provider that batches spans to `config.exporter`.

    Call once at process start, before `server_interceptors`/`client_interceptors`.
    Calling it again replaces the provider sciproto uses (the previous one is
    flushed and shut down); OpenTelemetry's global provider, which third-party
    instrumentation reads, can only be set by the first call.
    """
    global _provider, _global_provider_installed
    shutdown_tracing()
    if not config.enabled:
        return
    resource = Resource.create({SERVICE_NAME: config.service_name or service_name, SERVICE_VERSION: __version__})
    provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)))
    provider.add_span_processor(BatchSpanProcessor(_make_exporter(config)))
    set_global_textmap(_W3C)
    if not _global_provider_installed:
        trace.set_tracer_provider(provider)
        _global_provider_installed = True
    _provider = provider


def _make_exporter(config: TracingConfig) -> SpanExporter:
    if config.exporter == "jsonl":
        assert config.jsonl_path is not None  # checked by TracingConfig
        return JsonlSpanExporter(config.jsonl_path)
    if config.exporter == "console":
        return ConsoleSpanExporter(service_name=config.service_name)
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=config.otlp_endpoint, insecure=config.otlp_endpoint.startswith("http://"))


def tracing_enabled() -> bool:
    """True between `setup_tracing` with an exporter and `shutdown_tracing`."""
    return _provider is not None


def flush_tracing(timeout_s: float = 10.0) -> bool:
    """Export every finished span now; False if the exporter did not finish in time."""
    return _provider.force_flush(int(timeout_s * 1000)) if _provider is not None else True


def shutdown_tracing() -> None:
    """Flush and stop the exporter. Safe to call when tracing is off or already shut down."""
    global _provider
    if _provider is not None:
        _provider.shutdown()
        _provider = None


def _require_setup(config: TracingConfig, what: str) -> TracerProvider | None:
    if not config.enabled:
        return None
    if _provider is None:
        raise RuntimeError(f"tracing exporter is {config.exporter!r} but setup_tracing() was not called: "
                           f"call setup_tracing(config, service_name) before {what}(config)")
    return _provider


def server_interceptors(config: TracingConfig) -> list[grpc.aio.ServerInterceptor]:
    """A SERVER span per RPC, child of the caller's metadata context; [] when tracing is off."""
    provider = _require_setup(config, "server_interceptors")
    return [aio_server_interceptor(tracer_provider=provider, filter_=_TRACED_RPCS)] if provider else []


def client_interceptors(config: TracingConfig) -> list[grpc.aio.ClientInterceptor]:
    """A CLIENT span per RPC, its context sent in metadata; [] when tracing is off.
    Pass to `make_channel(target, interceptors=...)`."""
    provider = _require_setup(config, "client_interceptors")
    return list(aio_client_interceptors(tracer_provider=provider, filter_=_TRACED_RPCS)) if provider else []


def _carrier_of_current_span() -> dict[str, str]:
    carrier: dict[str, str] = {}
    if trace.get_current_span().get_span_context().is_valid:
        _W3C.inject(carrier)
    return carrier


def inject_metadata() -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying the current span (traceparent, tracestate); () without one."""
    return tuple(_carrier_of_current_span().items())


def current_trace_context() -> common_pb2.TraceContext:
    """The current span, for a request's `trace_context` field; empty without one."""
    carrier = _carrier_of_current_span()
    return common_pb2.TraceContext(traceparent=carrier.get("traceparent", ""),
                                   tracestate=carrier.get("tracestate", ""))


@contextlib.contextmanager
def outside_any_trace() -> Iterator[None]:
    """No current span for the block: a long-lived call started here (a stream shared by many
    episodes) gets a trace of its own instead of joining whichever episode happened to start it."""
    token = otel_context.attach(Context())
    try:
        yield
    finally:
        otel_context.detach(token)


def current_trace_id() -> str:
    """32 hex digits of the current trace (for the rollout's `trace_id`), or ""."""
    span_context = trace.get_current_span().get_span_context()
    return f"{span_context.trace_id:032x}" if span_context.is_valid else ""


def _context_from_carrier(carrier: dict[str, str]) -> Context | None:
    # A malformed traceparent is ignored, not refused: W3C Trace Context says a
    # receiver restarts the trace rather than failing the request.
    if not carrier.get("traceparent"):
        return None
    extracted = _W3C.extract(carrier, context=Context())
    return extracted if trace.get_current_span(extracted).get_span_context().is_valid else None


def _context_from_field(field: common_pb2.TraceContext | None) -> Context | None:
    if field is None:
        return None
    return _context_from_carrier({"traceparent": field.traceparent, "tracestate": field.tracestate})


def _context_from_metadata(metadata: Iterable[tuple[str, Any]] | None) -> Context | None:
    return _context_from_carrier({key: value for key, value in (metadata or ())
                                  if key in ("traceparent", "tracestate") and isinstance(value, str)})


def extract_context(grpc_metadata: Iterable[tuple[str, Any]] | None,
                    trace_context_field: common_pb2.TraceContext | None = None) -> Context:
    """The caller's context: from gRPC metadata first (the contract gives it
    precedence), else from the request's `trace_context` field, else an empty
    context (the span becomes the root of a new trace)."""
    return _context_from_metadata(grpc_metadata) or _context_from_field(trace_context_field) or Context()


def _attributes(attributes: dict[str, AttributeValue | None]) -> dict[str, AttributeValue]:
    return {key: value for key, value in attributes.items() if value is not None}


def _tracer(provider: TracerProvider) -> trace.Tracer:
    return provider.get_tracer("sciproto", __version__)


@contextlib.contextmanager
def start_span(name: str, kind: SpanKind = SpanKind.INTERNAL,
               **attributes: AttributeValue | None) -> Iterator[trace.Span]:
    """A span under the current one, made current for the block. Attribute
    names have dots, so pass them unpacked: `**{Attr.TASK_ID: "gsm8k/test/3"}`;
    None values are left out. An exception escaping the block marks it ERROR."""
    if _provider is None:
        yield trace.INVALID_SPAN
        return
    with _tracer(_provider).start_as_current_span(name, kind=kind, attributes=_attributes(attributes)) as span:
        yield span


@contextlib.contextmanager
def span_for_request(name: str, context: grpc.aio.ServicerContext | None,
                     trace_context_field: common_pb2.TraceContext | None = None,
                     **attributes: AttributeValue | None) -> Iterator[trace.Span]:
    """A server-side span for one request, made current for the block.

    Its parent is the most specific one known to belong to the request:
    - the current span (the RPC's own span from `server_interceptors`) when it
      is in the trace the request names, or the request names none;
    - else the request's `trace_context` field: on a stream multiplexing many
      episodes, each message names its own episode's trace;
    - else the call's metadata (servers without the interceptor).
    """
    if _provider is None:
        yield trace.INVALID_SPAN
        return
    current = trace.get_current_span().get_span_context()
    requested = _context_from_field(trace_context_field)
    parent: Context | None
    if current.is_valid and (requested is None or _trace_id(requested) == current.trace_id):
        parent, kind = None, SpanKind.INTERNAL
    elif requested is not None:
        parent, kind = requested, SpanKind.SERVER
    else:
        parent = _context_from_metadata(context.invocation_metadata() if context is not None else None)
        kind = SpanKind.SERVER
    # parent None: under the current span, or a new trace when there is none.
    with _tracer(_provider).start_as_current_span(name, context=parent, kind=kind,
                                                  attributes=_attributes(attributes)) as span:
        yield span


def _trace_id(context: Context) -> int:
    return trace.get_current_span(context).get_span_context().trace_id
