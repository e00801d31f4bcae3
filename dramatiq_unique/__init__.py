"""dramatiq-unique: unique jobs and per-key locks for Dramatiq.

Add the middleware, then give actors a ``lock``::

  broker.add_middleware(UniqueMiddleware())

  @dramatiq.actor(lock="while_executing", on_conflict="reschedule")
  def sync_account_balance(account_id): ...
"""

from __future__ import annotations

from .backend import Acquisition, EnqueueRecord, LockBackend, LockInfo, Release
from .backends import StubBackend
from .delivery import fence_token
from .errors import (
    ConfigurationError,
    DuplicateMessage,
    LockBackendError,
    LockConflict,
    Rescheduled,
    UniqueError,
)
from .events import EVENTS, LockEvent
from .locks import LOCK_TYPES, STRATEGIES, LockType
from .middleware import UniqueMiddleware, digest_for
from .settings import (
    DEFAULT_LEASE,
    DEFAULT_LOCK_TTL,
    DEFAULT_ON_BACKEND_ERROR,
    DEFAULT_PREFIX,
    DEFAULT_PROVISIONAL_WINDOW,
    DEFAULT_REAP_INTERVAL,
    DEFAULT_RESCHEDULE_DELAY,
)

__version__ = "0.1.0"

__all__ = [
    "Acquisition",
    "ConfigurationError",
    "DEFAULT_LEASE",
    "DEFAULT_LOCK_TTL",
    "DEFAULT_ON_BACKEND_ERROR",
    "DEFAULT_PREFIX",
    "DEFAULT_PROVISIONAL_WINDOW",
    "DEFAULT_REAP_INTERVAL",
    "DEFAULT_RESCHEDULE_DELAY",
    "DuplicateMessage",
    "EnqueueRecord",
    "EVENTS",
    "LOCK_TYPES",
    "LockBackend",
    "LockBackendError",
    "LockConflict",
    "LockEvent",
    "LockInfo",
    "LockType",
    "Release",
    "Rescheduled",
    "STRATEGIES",
    "StubBackend",
    "UniqueError",
    "UniqueMiddleware",
    "digest_for",
    "fence_token",
]
