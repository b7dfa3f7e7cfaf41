"""sciproto: gRPC contracts and servers for training LLM agents with RL on scientific tasks."""

from sciproto.version import PROTOCOL_VERSION, __version__

__all__ = ["PROTOCOL_VERSION", "__version__"]
