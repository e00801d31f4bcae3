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
    from .backends.base import LockBackend
    from .backends.records import Acquisition, EnqueueRecord, LockInfo, Release, Replacement
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
    from .model.spec import LOCK_TYPES, STRATEGIES, LockType
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

#: The homes of the public names, lightest first; each is imported on first use, so that a light
#: module (``testing``, a pytest plugin; ``settings``; the CLI) imports neither Dramatiq nor redis.
_HOMES = (
    ".settings",
    ".errors",
    ".events",
    ".model.spec",
    ".backends.records",
    ".backends.base",
    ".backends",
    ".worker.leases",
    ".middleware",
)


def __getattr__(name: str) -> Any:
    for home in _HOMES if name in __all__ else ():
        module = importlib.import_module(home, __name__)
        if hasattr(module, name):
            globals()[name] = value = getattr(module, name)
            return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


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
