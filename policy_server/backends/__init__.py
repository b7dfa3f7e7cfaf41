"""Policy backends: where tokens are sampled."""

from policy_server.backends.base import PolicyBackend

__all__ = ["PolicyBackend"]
