"""A minimal EnvironmentService on the core bootstrap, to test the bootstrap
itself (health, reflection, errors, deadlines, drain, TLS, auth) in a
separate process.

    python probe_server.py [GRACE_S] [--set key.path=value ...] [--verbose]

`--set` overrides the probe's config like a component's (`server.tls.cert=...`,
`auth.file=...`). Step's episode_id picks the behaviour: "" is a bad request,
"sleep:S" sleeps S seconds then answers, "crash" raises an unexpected
exception, "whoami" answers with the caller's principal in info, "claim"
takes one live-episode claim for the caller (never released), anything else
is an unknown episode.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from pydantic import BaseModel, Field

from sciproto import pb
from sciproto.auth import AuthConfig, claim_episode, current_principal
from sciproto.config import load_config
from sciproto.errors import InvalidArgument, NotFound, Reason
from sciproto.limits import EpisodeClaim
from sciproto.server import (
    ServerConfig,
    Service,
    announce_port,
    serve_until_signalled,
    server_info,
    start_server,
)


class ProbeConfig(BaseModel):
    server: ServerConfig = Field(default_factory=ServerConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)


class ProbeEnvironmentService(pb.env_grpc.EnvironmentServiceServicer):
    def __init__(self, config: ProbeConfig) -> None:
        self.config = config
        self.claims: list[EpisodeClaim] = []

    async def Describe(self, request, context):
        server = server_info(self.config.server, "probe", ["probe"], service=pb.ENV_SERVICE, auth=self.config.auth)
        return pb.env_pb2.EnvironmentServiceDescribeResponse(server=server)

    async def Step(self, request, context):
        if not request.episode_id:
            raise InvalidArgument("episode_id is empty: pass the id Reset returned", Reason.INVALID_REQUEST)
        if request.episode_id.startswith("sleep:"):
            await asyncio.sleep(float(request.episode_id.split(":", 1)[1]))
            return pb.env_pb2.StepResponse(step_count=1)
        if request.episode_id == "crash":
            raise RuntimeError("probe crash")
        if request.episode_id == "whoami":
            principal = current_principal()
            return pb.env_pb2.StepResponse(info={"principal": principal.name if principal else ""})
        if request.episode_id == "claim":
            self.claims.append(claim_episode())
            return pb.env_pb2.StepResponse(step_count=len(self.claims))
        raise NotFound(f"no episode {request.episode_id!r}", Reason.EPISODE_NOT_FOUND)


async def main(grace_s: float, overrides: list[str]) -> None:
    defaults = ["server.port=0", f"server.max_receive_message_bytes={1024 * 1024}", f"server.grace_period_s={grace_s}"]
    config = load_config(ProbeConfig, None, [*defaults, *overrides])
    servicer = ProbeEnvironmentService(config)
    service = Service(pb.ENV_SERVICE, servicer, pb.env_grpc.add_EnvironmentServiceServicer_to_server)
    running = await start_server(config.server, [service], auth=config.auth)
    await serve_until_signalled(running, on_ready=lambda port: announce_port("probe", port))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("grace_s", nargs="?", type=float, default=10.0)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(main(args.grace_s, args.overrides))
