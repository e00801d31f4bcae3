"""The Redis lock backend: :class:`RedisBackend` (in :mod:`.client`),
its script calls and their group commit (:mod:`.calls`), and the Lua
scripts (``lua/``).
"""

from .client import RedisBackend, TooFewReplicas

__all__ = ["RedisBackend", "TooFewReplicas"]
