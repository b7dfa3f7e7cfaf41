"""Inside a Ray actor: one sciproto server (`ServerHost`), started by its constructor with the same
start-up code as `sciproto serve env|policy|learner`, bound to port 0 on the node's IP. Ray runs
the constructor again when it restarts the actor, so a restarted server reports its new address.
A learner rank other than 0 serves nothing (its address has port 0): it follows rank 0 until rank 0
stops it, and if it ends otherwise (rank 0 gone, a failed call) its process exits, so Ray reports
the actor dead. This module imports Ray only inside the actor."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

if TYPE_CHECKING:
    from sciproto.server import RunningServer

log = logging.getLogger(__name__)


def one_line(error: BaseException) -> str:
    """`error` as one line: its type and the first line of its message; for a config that does not
    validate, the first field at fault and what its check says (the first line of pydantic's
    message only counts the errors)."""
    if isinstance(error, ValidationError) and error.errors():
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or error.title
        return f"{where}: {first['msg']}"
    text = str(getattr(error, "headline", None) or error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


async def _start_role(role: str, section: dict[str, Any], host: str) -> RunningServer:
    """Start the server of `role` from its config section, bound to `host` port 0."""
    section = {**section, "server": {**section.get("server", {}), "host": host, "port": 0}}
    if role == "env":
        from env_servers import app as env_app
        from env_servers.config import EnvServerConfig

        settings = EnvServerConfig.model_validate(section)
        return await env_app.start(settings, env_app.load_sources(settings), settings.auth.load())
    if role == "policy":
        from policy_server import app as policy_app
        from policy_server.config import PolicyServerConfig

        policy = PolicyServerConfig.model_validate(section)
        return await policy_app.start(policy, policy.auth.load())
    if role == "learner":
        from learner import app as learner_app
        from learner.server_config import LearnerServerConfig

        learner = LearnerServerConfig.model_validate(section)
        return await learner_app.start(learner, learner.auth.load())
    raise ValueError(f"unknown role {role!r}")


class ServerHost:
    """A Ray actor holding one sciproto server. Its constructor starts the server (in a thread of
    its own, with its own event loop) and returns once it listens; Ray runs the constructor again
    when it restarts the actor."""

    def __init__(self, role: str, section: dict[str, Any], log_file: str | None, start_timeout_s: float) -> None:
        import ray

        self.role = role
        self.node_ip = ray.util.get_node_ip_address()
        self._node_id = ray.get_runtime_context().get_node_id()
        if log_file is not None:
            _log_to(Path(log_file))
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._port = 0
        self._running: RunningServer | None = None
        self._error = ""
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(section),),
                                        name=f"sciproto {role}", daemon=True)
        self._thread.start()
        if not self._ready.wait(start_timeout_s):
            raise TimeoutError(f"the {role} server did not start within {start_timeout_s:g} s")
        if self._error:
            raise RuntimeError(f"the {role} server did not start: {self._error}")

    async def _serve(self, section: dict[str, Any]) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            running = await _start_role(self.role, section, self.node_ip)
        except BaseException as error:
            log.exception("%s server did not start", self.role)
            self._error = one_line(error)
            self._ready.set()
            return
        self._port = running.port
        self._running = running
        self._ready.set()
        stop = asyncio.ensure_future(self._stop.wait())
        ended = asyncio.ensure_future(running.wait())
        await asyncio.wait({stop, ended}, return_when=asyncio.FIRST_COMPLETED)
        if ended.done() and ended.exception() is not None:
            # Only a learner rank other than 0 ends by itself (its rank 0 is gone, or a collective
            # call failed): its process ends, so Ray reports the actor dead and the run stops.
            log.error("the %s server ended: %s", self.role, one_line(ended.exception()))
            logging.shutdown()
            os._exit(1)
        await stop  # a follower that rank 0 stopped waits for its own stop
        await running.stop()
        # Not cancelled: a gRPC server's wait shares a future with its stop. It ends with the stop.
        await asyncio.wait({ended}, timeout=5)

    def address(self) -> str:
        """`node_ip:port` of the server (never localhost on a real cluster)."""
        return f"{self.node_ip}:{self._port}"

    def node_id(self) -> str:
        return self._node_id

    def retarget_policy(self, index: int, target: str, timeout_s: float = 60.0) -> bool:
        """On the learner: policy server `index` moved to `target` (see LearnerServicer.retarget_policy)."""
        assert self._loop is not None and self._running is not None
        servicer = self._running.services[0].servicer
        return asyncio.run_coroutine_threadsafe(servicer.retarget_policy(index, target), self._loop).result(timeout_s)

    def stop(self, timeout_s: float) -> bool:
        """Stop the server (the learner finishes its step and checkpoints); True once it has."""
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


def _log_to(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)


__all__ = ["ServerHost", "one_line"]
