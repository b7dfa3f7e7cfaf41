"""A minimal EnvironmentService on the core bootstrap, to test the bootstrap
itself (health, reflection, errors, deadlines, drain) in a separate process.

Step's episode_id picks the behaviour: "" is a bad request, "sleep:S" sleeps
S seconds then answers, "crash" raises an unexpected exception, anything else
is an unknown episode.
"""

from __future__ import annotations

import asyncio
import sys

from sciproto import pb
from sciproto.errors import InvalidArgument, NotFound, Reason
from sciproto.server import ServerConfig, Service, announce_port, serve_until_signalled, start_server
from sciproto.version import PROTOCOL_VERSION, __version__


class ProbeEnvironmentService(pb.env_grpc.EnvironmentServiceServicer):
    def __init__(self, config: ServerConfig) -> None:
        self.config = config

    async def Describe(self, request, context):  # noqa: N802 (gRPC method name)
        server = pb.common_pb2.ServerInfo(protocol_version=PROTOCOL_VERSION, server_version=__version__,
                                          implementation="probe", limits=self.config.message_limits())
        return pb.env_pb2.EnvironmentServiceDescribeResponse(server=server)

    async def Step(self, request, context):  # noqa: N802
        if not request.episode_id:
            raise InvalidArgument("episode_id is empty: pass the id Reset returned", Reason.INVALID_REQUEST)
        if request.episode_id.startswith("sleep:"):
            await asyncio.sleep(float(request.episode_id.split(":", 1)[1]))
            return pb.env_pb2.StepResponse(step_count=1)
        if request.episode_id == "crash":
            raise RuntimeError("probe crash")
        raise NotFound(f"no episode {request.episode_id!r}", Reason.EPISODE_NOT_FOUND)


async def main(grace_s: float) -> None:
    config = ServerConfig(port=0, grace_period_s=grace_s, max_receive_message_bytes=1024 * 1024)
    servicer = ProbeEnvironmentService(config)
    running = await start_server(config, [Service(pb.ENV_SERVICE, servicer, pb.env_grpc.add_EnvironmentServiceServicer_to_server)])
    await serve_until_signalled(running, on_ready=lambda port: announce_port("probe", port))


if __name__ == "__main__":
    asyncio.run(main(float(sys.argv[1]) if len(sys.argv) > 1 else 10.0))
