"""The Redis lock backend: :class:`RedisBackend` (in :mod:`.client`),
its script calls (:mod:`.calls`), their group commit (:mod:`.group`)
and the Lua scripts (``lua/``).
"""

from .client import RedisBackend, TooFewReplicas

__all__ = ["RedisBackend", "TooFewReplicas"]
