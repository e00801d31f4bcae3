"""Telling a worker's lock troubles that no delivery waits for: a lease
lost or not renewed, releases stalled in the backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..background import now_ms
from ..events import LockEvent
from ..model.wire import message_id_of
from ..send.context import LockContext

if TYPE_CHECKING:
    from .leases import Lease
    from .releaser import PendingRelease


class LockTroubles:
    """Logs and counts the lock troubles of one middleware.

    Parameters:
      service(LockContext): The middleware's lock context.
    """

    def __init__(self, service: LockContext) -> None:
        self.service = service

    def lost(self, actor: str, key: str, owner: str) -> None:
        """A run lock that ``owner`` held was lost before its release."""
        self.service.logger.error(
            "Lock %r was lost: message %s no longer holds it (its lease expired or it was taken over).",
            key,
            message_id_of(owner),
        )
        self.service.events.emit(LockEvent("lock_lost", actor, key, message_id_of(owner)))

    def lease_lost(self, lease: "Lease") -> None:
        self.lost(lease.actor, lease.key, lease.owner)

    def renewal_failed(self, lease: "Lease") -> None:
        self.service.events.emit(LockEvent("backend_error", lease.actor, lease.key, message_id_of(lease.owner)))

    def releases_stalled(self, batch: list["PendingRelease"]) -> None:
        """Report releases still waiting for the backend."""
        self.service.logger.error(
            "Lock backend %s has not answered %d release(s) for %.0f ms; the keys stay held until it does "
            "or their leases expire.",
            self.service.locks.describe(),
            len(batch),
            now_ms() - min(pending.submitted_at for pending in batch),
        )
        for pending in batch:
            self.service.events.emit(
                LockEvent("backend_error", pending.actor, pending.key, message_id_of(pending.owner))
            )
