"""dramatiq-unique: unique jobs and per-key locks for Dramatiq.

Add the middleware, then give actors a ``lock``::

  broker.add_middleware(UniqueMiddleware())

  @dramatiq.actor(lock="while_executing", on_conflict="reschedule")
  def sync_account_balance(account_id): ...
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .backends import StubBackend
    from .backends.base import Acquisition, EnqueueRecord, LockBackend, LockInfo, Release, Replacement
    from .errors import (
        ConfigurationError,
        DuplicateMessage,
        LockBackendError,
        LockConflict,
        Rescheduled,
        Superseded,
        UniqueError,
    )
    from .events import EVENTS, LockEvent
    from .middleware import UniqueMiddleware, digest_for
    from .model.locks import LOCK_TYPES, STRATEGIES, LockType
    from .settings import (
        DEFAULT_LEASE,
        DEFAULT_LOCK_TTL,
        DEFAULT_ON_BACKEND_ERROR,
        DEFAULT_PREFIX,
        DEFAULT_PROVISIONAL_WINDOW,
        DEFAULT_REAP_INTERVAL,
        DEFAULT_RESCHEDULE_DELAY,
    )
    from .worker.leases import fence_token

__version__ = "0.1.0"

#: Where each public name lives.  They are imported on first use, so
#: that importing a light module (``dramatiq_unique.testing``, loaded by
#: pytest as a plugin; ``settings``; the CLI) imports neither Dramatiq
#: nor redis.
_EXPORTS = {
    "Acquisition": ".backends.base",
    "EnqueueRecord": ".backends.base",
    "LockBackend": ".backends.base",
    "LockInfo": ".backends.base",
    "Release": ".backends.base",
    "Replacement": ".backends.base",
    "StubBackend": ".backends",
    "fence_token": ".worker.leases",
    "ConfigurationError": ".errors",
    "DuplicateMessage": ".errors",
    "LockBackendError": ".errors",
    "LockConflict": ".errors",
    "Rescheduled": ".errors",
    "Superseded": ".errors",
    "UniqueError": ".errors",
    "EVENTS": ".events",
    "LockEvent": ".events",
    "LOCK_TYPES": ".model.locks",
    "STRATEGIES": ".model.locks",
    "LockType": ".model.locks",
    "UniqueMiddleware": ".middleware",
    "digest_for": ".middleware",
    "DEFAULT_LEASE": ".settings",
    "DEFAULT_LOCK_TTL": ".settings",
    "DEFAULT_ON_BACKEND_ERROR": ".settings",
    "DEFAULT_PREFIX": ".settings",
    "DEFAULT_PROVISIONAL_WINDOW": ".settings",
    "DEFAULT_REAP_INTERVAL": ".settings",
    "DEFAULT_RESCHEDULE_DELAY": ".settings",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


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
    "Replacement",
    "Rescheduled",
    "STRATEGIES",
    "StubBackend",
    "Superseded",
    "UniqueError",
    "UniqueMiddleware",
    "digest_for",
    "fence_token",
]
