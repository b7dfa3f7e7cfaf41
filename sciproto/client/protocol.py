"""A client refuses a server of another MAJOR protocol version.

The wire contract's MINOR versions only add fields, messages and RPCs, which either side ignores;
a MAJOR version may change what a message means. So every client reads
`ServerInfo.protocol_version` from the server's Describe and refuses one whose MAJOR differs from
`sciproto.version.PROTOCOL_VERSION`'s, before any work: `EnvClient.describe`,
`PolicyClient.describe` and the training client's learner stream check it.
"""

from __future__ import annotations

from sciproto.errors import FailedPrecondition, Reason
from sciproto.pb import common_pb2
from sciproto.version import PROTOCOL_VERSION, __version__, protocol_compatible

__all__ = ["check_protocol"]


def check_protocol(server: common_pb2.ServerInfo, service: str, target: str) -> None:
    """Raise FailedPrecondition (reason INCOMPATIBLE_PROTOCOL) when `server` reports a protocol
    version whose MAJOR differs from this client's. A server that reports none is taken as it is
    (every sciproto server reports one)."""
    reported = server.protocol_version
    if not reported or protocol_compatible(reported):
        return
    major = PROTOCOL_VERSION.split(".", 1)[0]
    where = f" at {target}" if target else ""
    raise FailedPrecondition(
        f"the {service} server{where} speaks protocol {reported} and this client (sciproto {__version__}) "
        f"speaks {PROTOCOL_VERSION}: a different major version, whose messages may mean other things; use a "
        f"server of protocol {major}.x or a client of its version ({server.implementation or 'the server'} "
        f"{server.server_version})".rstrip(),
        Reason.INCOMPATIBLE_PROTOCOL,
        metadata={"server_protocol": reported, "client_protocol": PROTOCOL_VERSION, "target": target},
    )
