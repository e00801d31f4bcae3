"""The Redis lock backend: :class:`RedisBackend` (in :mod:`.client`,
with the operators' reads in :mod:`.reads`), its script calls and their
group commit (:mod:`.calls`), the Lua scripts (``lua/``, loaded by
:mod:`.scripts`) and ``min_replicas`` (:mod:`.replicas`).
"""

from .client import RedisBackend
from .replicas import TooFewReplicas

__all__ = ["RedisBackend", "TooFewReplicas"]
