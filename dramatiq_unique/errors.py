"""Errors raised by dramatiq-unique.

Dramatiq swallows what a ``before_*`` hook raises unless it is a ``MiddlewareError``, so every error
that must stop an enqueue, a declaration or a delivery derives from it.
"""

from __future__ import annotations

from typing import Optional

from dramatiq.errors import DramatiqError
from dramatiq.middleware import MiddlewareError, SkipMessage


class UniqueError(DramatiqError):
    """Base class for all dramatiq-unique errors."""


class ConfigurationError(UniqueError, MiddlewareError, ValueError):
    """Raised for an invalid actor option, constructor argument or environment variable."""


class DuplicateMessage(UniqueError, MiddlewareError):
    """Raised by ``send()`` when ``on_conflict="raise"`` and the key is held.  Nothing was enqueued.

    Attributes:
      holder(str): The message id of the message that holds it.
    """

    def __init__(self, message: str, *, key: str, holder: Optional[str]) -> None:
        super().__init__(message)
        self.key = key
        self.holder = holder


class LockConflict(UniqueError, MiddlewareError):
    """Raised in the worker when ``on_conflict={"server": "raise"}`` and the run lock is held: the
    delivery fails and goes through Retries.
    """

    def __init__(self, message: str, *, key: str, holder: Optional[str]) -> None:
        super().__init__(message)
        self.key = key
        self.holder = holder


class LockBackendError(UniqueError, MiddlewareError):
    """Raised when the lock backend cannot be reached or fails: no message is enqueued or run without its lock.

    Attributes:
      backend(str): A description of the backend, e.g. its URL.
    """

    def __init__(self, message: str, *, backend: str) -> None:
        super().__init__(message)
        self.backend = backend


class Rescheduled(UniqueError, SkipMessage):
    """Raised to skip a delivery re-enqueued because its key was held; not counted against ``max_retries``."""


class CopySkipped(UniqueError, SkipMessage):
    """Raised to skip a copy of a message when another copy of it runs instead (the other copy of a
    reschedule, or one of an earlier reschedule).  It stores no result and is not retried.
    """


class Superseded(UniqueError):
    """Stored as the result of a message a newer send replaced (``on_conflict="replace"`` or
    ``debounce``): it did not run, and a caller waiting on it gets a ``ResultFailure`` naming this.

    Attributes:
      key(str): The enqueue lock key.
      by(str): The message id of the message that replaced it.
    """

    def __init__(self, message: str, *, key: str, by: str) -> None:
        super().__init__(message)
        self.key = key
        self.by = by
