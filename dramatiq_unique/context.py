"""What the guards need of the middleware they work for.

The enqueue and process guards, replace and debounce, the send fast
path and the reaper each act for one
:class:`~dramatiq_unique.middleware.UniqueMiddleware`, but they depend
on this protocol only: the middleware imports them, never the reverse,
so the package has no import circle.  The middleware is the one
implementation.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional, Protocol

if TYPE_CHECKING:
    from .backend import LockBackend
    from .errors import LockBackendError
    from .events import EventHub
    from .leases import LeaseKeeper
    from .releaser import Releaser
    from .unreleased import ReleaseRetries
    from .settings import Settings
    from .spec import ActorSpec


class GuardContext(Protocol):
    """The middleware's state and services, as its guards use them."""

    logger: logging.Logger
    settings: "Settings"
    events: "EventHub"
    specs: dict[str, "ActorSpec"]
    enabled: bool
    record_lock_args: bool
    async_actors: set[str]

    @property
    def backend(self) -> Optional["LockBackend"]:
        """Where the locks live; None until the middleware is attached."""

    @property
    def leases(self) -> "LeaseKeeper":
        """The process's run leases."""

    @property
    def releaser(self) -> Optional["Releaser"]:
        """Releases run locks off the worker thread, when the backend
        batches releases.
        """

    @property
    def release_retries(self) -> "ReleaseRetries":
        """Sends failed releases again, off the worker thread."""

    def key(self, spec: "ActorSpec", digest: str, phase: str) -> str:
        """The backend key of one lock."""

    def emit(self, name: str, spec: "ActorSpec", key: str, message: Any, holder: Optional[str] = None) -> None:
        """Count a lock event and pass it to the listeners."""

    def backend_error(
        self, action: str, key: str, spec: "ActorSpec", message: Any, error: Exception
    ) -> "LockBackendError":
        """Log and count a backend failure, and wrap it."""
