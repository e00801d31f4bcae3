"""Releasing the locks of a delivery when its run ends, and reporting
each release where its outcome arrives.

A run lock's release goes to the :class:`~.releaser.Releaser` when the
backend batches releases, else straight to the backend; a release that
handed the key to a waiter leaves a :class:`~.delivery.HandOff` to
enqueue, and a release that failed is sent again by
:class:`~.failed.FailedReleases`.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Optional

from dramatiq import Message

from ..backends.base import Release
from ..background import now_ms
from ..model.wire import UNIQUE_RESCHEDULES
from ..send.context import LockContext
from .conflict import reserve
from .delivery import Delivery, HandOff, LockToRelease, set_fence
from .failed import FailedRelease
from .releaser import Outcome, PendingRelease
from .reports import LockTroubles
from .threads import WorkerThreads

if TYPE_CHECKING:
    from dramatiq import Broker
    from dramatiq.broker import MessageProxy


class Unlocker:
    """Releases the locks of each delivery of one middleware.  It owns
    the worker's background threads, which report releases back to it.

    Parameters:
      service(LockContext): The middleware's lock context.
      troubles(LockTroubles): Where lost locks are told.
    """

    def __init__(self, service: LockContext, *, troubles: LockTroubles) -> None:
        self.service = service
        self.troubles = troubles
        self.threads = WorkerThreads(service, reports=self, troubles=troubles)

    def end_run(self, broker: "Broker", message: "MessageProxy", state: Delivery, *, succeeded: bool) -> None:
        """Release the run lock of this delivery, once, and hand the key
        to its longest waiter: in the background when the backend
        batches releases (see :mod:`dramatiq_unique.worker.releaser`).
        ``succeeded``: the run leaves nothing to do, and finishes its
        message (a failed run never does, whatever becomes of its retry).
        """
        if state.run_key is None or state.run_owner is None:
            return
        coroutine = state.coroutine
        if coroutine is not None and coroutine.defer(
            partial(self.end_run, broker, message, state, succeeded=succeeded)
        ):
            self.service.logger.error(
                "Message %s is still running after it was interrupted: its run lock %r is kept until it ends.",
                message,
                state.run_key,
            )
            return
        lock = LockToRelease(
            broker, message, state.spec, state.run_key, state.run_owner, state.lease, state.run_confirmed, succeeded
        )
        state.run_key = state.run_owner = state.lease = None
        set_fence(None)
        threads = self.threads
        if lock.lease is not None:
            threads.leases.drop(lock.lease)
        releaser = threads.releaser
        slot = reserve(self.service, lock.spec)
        if releaser is not None:
            actor = lock.spec.actor_name
            pending = PendingRelease(lock.key, lock.owner, actor, lock, succeeded=succeeded, reserve=slot)
            # A message that waited for its key most likely leaves waiters behind, the next of which waits for
            # this release: it goes at once rather than lingering for another call to ride with.
            if message.options.get(UNIQUE_RESCHEDULES):
                releaser.release_now(pending)
            else:
                releaser.submit(pending)
            return
        try:
            outcome: Outcome = self.service.locks.release(lock.key, lock.owner, succeeded=succeeded, reserve=slot)
        except Exception as e:
            outcome = e
        handoff = self._report(lock, outcome)
        if handoff is not None:
            self.hand_over(handoff)

    def release_queue_lock(self, message: "MessageProxy", state: Delivery, strict: bool = False) -> None:
        """Release the enqueue lock, once, unless the lock type has none
        or keeps it until it expires; ``strict`` raises on a backend
        failure so the delivery is retried instead of leaving the lock
        to block new sends until it expires.
        """
        if state.queue_released or state.spec.lock.queue_release in (None, "expiry"):
            return
        service = self.service
        key = service.key(state.spec, state.digest, "queue")
        try:
            released = service.locks.release(key, message.message_id)
        except Exception as e:
            error = service.backend_error("release", key, state.spec, message, e)
            if strict:
                raise error from e
            state.queue_released = True
            until = now_ms() + service.queue_lock_ttl(state.spec)
            lock = LockToRelease(None, message, state.spec, key, message.message_id)
            self.threads.failed.submit(FailedRelease(key, message.message_id, until, lock))
            return
        self.queue_lock_released(message, state, key, released.held)

    def queue_lock_released(self, message: "MessageProxy", state: Delivery, key: str, held: bool) -> None:
        """Report the release of an enqueue lock: ``held`` says whether
        it was still held until then.
        """
        service = self.service
        state.queue_released = True
        if held:
            service.emit("released", state.spec, key, message)
            return
        service.logger.warning(
            "Lock %r of message %s lapsed before it was released: raise its lock_ttl.", key, message.message_id
        )
        service.emit("lock_lost", state.spec, key, message)

    def released(self, pending: PendingRelease, outcome: Outcome) -> Optional[HandOff]:
        """Report a release the releaser sent (see :class:`~.releaser.ReleaseReports`)."""
        return self._report(pending.lock, outcome) if pending.lock is not None else None

    def _report(self, lock: LockToRelease, outcome: Outcome) -> Optional[HandOff]:
        """Report a run lock's release; return the hand-off to do, if it
        handed the key to a waiter: the caller does it where no job
        waits for it.  A release that failed is sent again saying how
        the run ended.
        """
        service, lease = self.service, lock.lease
        if isinstance(outcome, Exception):
            service.backend_error("release", lock.key, lock.spec, lock.message, outcome)
            # Sent again off this thread until it lands or the lease has run out.
            until = lease.expires_at if lease is not None else now_ms() + service.settings.lease
            self.threads.failed.submit(FailedRelease(lock.key, lock.owner, until, lock, succeeded=lock.succeeded))
            return None
        if outcome.held:
            service.emit("released", lock.spec, lock.key, lock.message)
        elif lock.confirmed and (lease is None or not lease.lost):
            self.troubles.lost(lock.spec.actor_name, lock.key, lock.owner)
        return _handoff(lock, outcome)

    def landed(self, failed: FailedRelease, outcome: Release) -> Optional[HandOff]:
        """Report a release that landed on a retry.  Its first send may
        have been applied, so an owner found gone is no lost lock.
        """
        lock = failed.lock
        if lock is None:
            return None
        if outcome.held:
            self.service.emit("released", lock.spec, lock.key, lock.message)
        return _handoff(lock, outcome)

    def hand_over(self, handoff: HandOff) -> None:
        """Enqueue the copy of the waiter a release handed its key to."""
        try:
            promoted = handoff.broker.enqueue(Message.decode(handoff.encoded))
        except Exception as e:
            self.service.logger.warning(
                "Could not hand %r to its next waiter (%r); it runs after its delay.", handoff.key, e
            )
            return
        self.threads.handoffs.handed_over(promoted.queue_name)


def _handoff(lock: LockToRelease, outcome: Release) -> Optional[HandOff]:
    """The hand-off a release left to do, if it handed the key over."""
    if outcome.promoted is None or lock.broker is None:
        return None
    return HandOff(lock.broker, lock.key, outcome.promoted)
