"""An EnvironmentService that only traces, to test propagation into a real
server process: `python tracing_probe_server.py EXPORTER [JSONL_PATH]`.

Step (unary) and every step on a Session stream open a span with
`span_for_request`, named "sciproto.env.step" with the episode id as an
attribute, and answer with what the span saw in `info`: its trace id and
whether it records.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator

import grpc

from sciproto import pb
from sciproto.server import (
    ServerConfig,
    Service,
    announce_port,
    serve_until_signalled,
    start_server,
)
from sciproto.tracing import (
    Attr,
    Operation,
    TracingConfig,
    current_trace_id,
    server_interceptors,
    setup_tracing,
    shutdown_tracing,
    span_for_request,
)


def traced_step(request: pb.env_pb2.StepRequest, context: grpc.aio.ServicerContext) -> pb.env_pb2.StepResponse:
    with span_for_request(Operation.ENV_STEP, context, request.trace_context,
                          **{Attr.EPISODE_ID: request.episode_id}) as span:
        info = {"trace_id": current_trace_id(), "recording": str(span.is_recording())}
        return pb.env_pb2.StepResponse(step_count=1, info=info)


class TracingProbeService(pb.env_grpc.EnvironmentServiceServicer):
    async def Step(self, request, context):
        return traced_step(request, context)

    async def Session(self, request_iterator, context) -> AsyncIterator[pb.env_pb2.SessionResponse]:
        async for request in request_iterator:
            step = request.step
            yield pb.env_pb2.SessionResponse(request_id=step.request_id, episode_id=step.episode_id,
                                             step=traced_step(step, context))


async def main(tracing: TracingConfig) -> None:
    setup_tracing(tracing, "tracing-probe")
    try:
        running = await start_server(
            ServerConfig(port=0, grace_period_s=5),
            [Service(pb.ENV_SERVICE, TracingProbeService(), pb.env_grpc.add_EnvironmentServiceServicer_to_server)],
            interceptors=server_interceptors(tracing),
        )
        await serve_until_signalled(running, on_ready=lambda port: announce_port("tracing-probe", port))
    finally:
        shutdown_tracing()


if __name__ == "__main__":
    exporter = sys.argv[1]
    asyncio.run(main(TracingConfig(exporter=exporter, jsonl_path=sys.argv[2] if len(sys.argv) > 2 else None)))
