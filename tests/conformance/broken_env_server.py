"""An env server with one deliberate contract violation, for testing the conformance kit:

    python -m tests.conformance.broken_env_server FAULT [--set key=value ...]

FAULT is one of
- `wrong_status`: an unknown environment is INVALID_ARGUMENT instead of NOT_FOUND;
- `double_step`: a retried Step with the same request_id is applied again;
- `leaky_session`: episodes opened on a Session stay open after the stream ends;
- `generous_grader`: Verify of a live episode grades every episode 1.0, an empty reply too.

Everything else is the real server (env_servers), hosting the toy environment.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import grpc

from env_servers import app
from env_servers.service import EnvironmentService
from env_servers.session import SessionStream
from sciproto.errors import InvalidArgument, Reason
from sciproto.pb import common_pb2, env_pb2


class _Forgetful(set[str]):
    """A set that keeps nothing: the stream forgets the episodes it opened."""

    def add(self, item: str) -> None:
        pass


class BrokenService(EnvironmentService):
    fault = ""

    def _source(self, env: str):  # type: ignore[no-untyped-def]
        if self.fault == "wrong_status" and env not in self.sources:
            raise InvalidArgument(f"no environment {env!r}", Reason.UNKNOWN_ENVIRONMENT)
        return super()._source(env)

    async def step(self, request: env_pb2.StepRequest, **options: object) -> env_pb2.StepResponse:
        if self.fault == "double_step":
            return await self._step(request)  # no idempotency cache
        return await super().step(request, **options)  # type: ignore[arg-type]

    def _episode_reward(self, episode_id: str) -> common_pb2.Reward:
        reward = super()._episode_reward(episode_id)
        if self.fault == "generous_grader":
            return common_pb2.Reward(value=1.0, status=common_pb2.REWARD_STATUS_SCORED)
        return reward

    async def Session(self, request_iterator: AsyncIterator[env_pb2.SessionRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[env_pb2.SessionResponse]:
        stream = SessionStream(self, self.config.heartbeat_interval_s, context)
        if self.fault == "leaky_session":
            stream._opened = _Forgetful()
        async for response in stream.run(request_iterator):
            yield response


def main() -> None:
    fault, overrides = sys.argv[1], sys.argv[2:]
    assert fault in ("wrong_status", "double_step", "leaky_session", "generous_grader"), fault
    BrokenService.fault = fault
    settings = app.load_settings(None, ["envs=[toy]", "server.port=0",
                                        *(value for flag, value in zip(overrides[::2], overrides[1::2], strict=True)
                                          if flag == "--set")])
    app.EnvironmentService = BrokenService  # type: ignore[misc]
    asyncio.run(app.serve(settings, app.load_sources(settings), None))


if __name__ == "__main__":
    main()
