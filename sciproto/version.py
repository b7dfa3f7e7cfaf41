"""Versions a server reports in Describe and a client checks before work starts."""

__version__ = "0.1.0"

# "MAJOR.MINOR" of the wire contract in proto/sciproto/v1. MINOR grows with
# backward-compatible additions (docs/changelog.md and proto/README.md say what each
# added); a client refuses a server of another MAJOR (sciproto.client.protocol).
PROTOCOL_VERSION = "1.5"


def protocol_compatible(server_protocol: str) -> bool:
    """True when a server speaking `server_protocol` can serve this client."""
    return server_protocol.split(".", 1)[0] == PROTOCOL_VERSION.split(".", 1)[0]
