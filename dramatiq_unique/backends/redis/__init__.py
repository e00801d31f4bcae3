"""The Redis lock backend: :class:`RedisBackend` (:mod:`.client`) and its parts."""

from .client import RedisBackend
from .replicas import TooFewReplicas

__all__ = ["RedisBackend", "TooFewReplicas"]
