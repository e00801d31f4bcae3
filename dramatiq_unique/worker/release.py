"""Releasing the locks of a delivery when its run ends, and the worker
process's background tasks that this needs.

A run lock's release goes to the :class:`~.releaser.Releaser` when the
backend batches releases, else straight to the backend; a release that
handed the key to a waiter leaves a :class:`~.leases.HandOff` to
enqueue, and a release that failed is sent again by
:class:`~.resend.FailedReleases`.  :class:`LockTroubles` tells what no
delivery waits for: a lease lost or not renewed, releases stalled in
the backend.

The background tasks of a worker process (lease renewals, batched
releases, retries of failed releases, hand-off polls, the periodic
reaper) are made by :class:`WorkerThreads`.  Each thread works on the
backend that was current when it was made: it is made on first use, and
a new backend (``UniqueMiddleware.backend = ...``) stops the lock
threads, so that the next use makes them afresh.

**Hand-off polls.**  When a run lock is released, its longest waiter is
enqueued at once (the hand-off).  Dramatiq's Redis consumer then finds
it on its next poll, but a consumer whose queue was empty for the length
of a job has backed off to 40–160 ms between polls, and a chain of
same-key jobs pays that on every hand-off.  So, after this process hands
a key over on a queue it consumes, its consumer polls that queue at most
every ``poll`` milliseconds (Dramatiq's own first backoff step) until no
hand-off has happened for ``hold`` milliseconds; then its own backoff
comes back (:class:`HandoffPolls`).  Only the consumer's backoff cap
(``timeout``) changes, and only on Dramatiq's Redis consumer; with any
other broker this does nothing.
"""

from __future__ import annotations

import threading
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

from dramatiq import Message
from dramatiq.common import q_name

from ..backends.capabilities import BatchedReleases
from ..backends.records import Release, Start
from ..background import BackgroundThread, now_ms, pid
from ..compat import redis_consumer_backoff, set_redis_consumer_backoff
from ..events import LockEvent
from ..model.spec import ActorSpec
from ..model.wire import UNIQUE_RESCHEDULES, message_id_of
from ..send.context import LockContext
from .leases import Delivery, HandOff, Lease, LeaseKeeper, LockToRelease, set_fence
from .reap import PeriodicReaper, start_reaper
from .releaser import Outcome, PendingRelease, Releaser, ReleaseReports
from .resend import RUN_SUFFIX, FailedRelease, FailedReleases, LandedReports, OwedRelease

if TYPE_CHECKING:
    from dramatiq import Broker
    from dramatiq.broker import MessageProxy

#: A slot handed to a waiter stays reserved for its message this many
#: reschedule delays (the longest a delayed copy of it takes to come,
#: when its hand-off copy is lost), plus RESERVE_SLACK milliseconds.
RESERVE_DELAYS = 2
RESERVE_SLACK = 1_000

#: The longest wait between two polls of a queue that just got a
#: hand-off, in milliseconds.
DEFAULT_POLL = 5

#: How long quick polling lasts after the last hand-off, in milliseconds.
DEFAULT_HOLD = 5_000

#: Guards the lazy creation of the threads: worker threads ask at once.
_MAKING = threading.Lock()


def reschedule_delay(service: LockContext, spec: ActorSpec) -> int:
    """The delay of a rescheduled copy of ``spec``'s messages, in ms."""
    return spec.reschedule_delay if spec.reschedule_delay is not None else service.settings.reschedule_delay


def reserve(service: LockContext, spec: ActorSpec) -> int:
    """How long a slot handed to a waiter of ``spec`` stays reserved for
    it, in milliseconds.
    """
    return RESERVE_DELAYS * reschedule_delay(service, spec) + RESERVE_SLACK


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


class Reports(ReleaseReports, LandedReports, Protocol):
    """Where the releaser and the retries of failed releases report."""


class WorkerThreads:
    """The background tasks of one middleware in a worker process.

    Parameters:
      service(LockContext): The middleware's lock context.
      reports(Reports): Where releases report their outcomes.
      troubles(LockTroubles): Where lost leases and stalled releases
        are told.
    """

    def __init__(self, service: LockContext, *, reports: Reports, troubles: LockTroubles) -> None:
        self.service = service
        self.reports = reports
        self.troubles = troubles
        self.handoffs = HandoffPolls()
        self._leases: Optional[LeaseKeeper] = None
        self._releaser: Optional[Releaser] = None
        self._failed: Optional[FailedReleases] = None
        self._reaper: Optional[PeriodicReaper] = None

    @property
    def leases(self) -> LeaseKeeper:
        """Renews the run leases of this process."""
        if self._leases is None:
            # Worker threads ask at once on their first jobs: one keeper, or
            # a lease held by a second one would be renewed after its release.
            with _MAKING:
                if self._leases is None:
                    self._leases = LeaseKeeper(
                        self.service.locks,
                        lease=self.service.settings.lease,
                        on_lost=self.troubles.lease_lost,
                        on_error=self.troubles.renewal_failed,
                    )
        return self._leases

    @property
    def releaser(self) -> Optional[Releaser]:
        """Releases run locks off the worker thread, when the backend
        batches releases; None when it does not.
        """
        backend = self.service.backend
        if self._releaser is None and isinstance(backend, BatchedReleases) and backend.batches_releases:
            with _MAKING:  # worker threads ask at once: make one
                if self._releaser is None:
                    self._releaser = Releaser(backend, reports=self.reports, on_stalled=self.troubles.releases_stalled)
        return self._releaser

    @property
    def take_run_lock(self) -> Callable[..., Start]:
        """The one take of a run lock (:meth:`LockBackend.start`): the
        releaser's, which sends the releases pending in this process in
        front of it, in the same round trip, when the backend batches
        releases; else the backend's own.
        """
        releaser = self.releaser
        return releaser.take_run_lock if releaser is not None else self.service.locks.start

    @property
    def failed(self) -> FailedReleases:
        """Sends the releases that failed again, off the worker thread."""
        if self._failed is None:
            with _MAKING:
                if self._failed is None:
                    ttl = self.service.settings.lock_ttl
                    self._failed = FailedReleases(self.service.locks, reports=self.reports, record_ttl=ttl)
        return self._failed

    def start_reaper(self, broker: "Broker") -> None:
        """Start the periodic reaper, once, if ``reap_interval`` asks for one."""
        if self._reaper is None:
            self._reaper = start_reaper(self.service, broker)

    def restart(self) -> None:
        """Stop the lock threads: the next use makes each on the backend current then."""
        leases, releaser, failed = self._leases, self._releaser, self._failed
        self._leases = self._releaser = self._failed = None
        if leases is not None:
            leases.stop()
        if releaser is not None:
            releaser.stop()
        if failed is not None:
            failed.stop()

    def stop(self, left: Callable[[], float]) -> list[OwedRelease]:
        """Stop every thread, each within what ``left`` says is left of
        the shutdown's bound, in milliseconds.

        Returns:
          list[OwedRelease]: The releases that could not be sent, for
          the next worker (:class:`~.resend.OwedReleases`).
        """
        self.handoffs.stop()
        owed: list[OwedRelease] = []
        if self._releaser is not None:
            owed += [self._owed(p.key, p.owner, now_ms(), p.options) for p in self._releaser.stop(left())]
        if self._failed is not None:
            # After the releaser, whose failures it takes.
            owed += [self._owed(f.key, f.owner, f.until, f.options) for f in self._failed.stop(left())]
        if self._leases is not None:
            self._leases.stop(timeout=left())
        if self._reaper is not None:
            self._reaper.stop(timeout=left())
            self._reaper = None
        return owed

    def _owed(self, key: str, owner: str, until: float, options: dict[str, Any]) -> OwedRelease:
        """A release to hand on, from its lock's monotonic expiry.  A run
        lock's release is made even after its lease ran out: it also
        ends the run of a rescheduled message in its record, which lives
        ``lock_ttl``, so that a duplicate of that run is skipped.
        """
        if key.endswith(RUN_SUFFIX):
            until = max(until, now_ms() + self.service.settings.lock_ttl)
        return OwedRelease.within(key, owner, until - now_ms(), options)


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

    def lease_lost(self, lease: Lease) -> None:
        self.lost(lease.actor, lease.key, lease.owner)

    def renewal_failed(self, lease: Lease) -> None:
        self.service.events.emit(LockEvent("backend_error", lease.actor, lease.key, message_id_of(lease.owner)))

    def releases_stalled(self, batch: list[PendingRelease]) -> None:
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


class HandoffPolls:
    """Speeds up this process's Redis consumers after a hand-off.

    Parameters:
      poll(int): The backoff cap while a hand-off may follow, in ms.
      hold(int): How long it lasts after the last hand-off, in ms.
    """

    def __init__(self, *, poll: int = DEFAULT_POLL, hold: int = DEFAULT_HOLD) -> None:
        self.poll = poll
        self.hold = hold
        self._threads: dict[str, Any] = {}  # queue name -> Dramatiq ConsumerThread
        self._saved: dict[int, tuple[Any, int]] = {}  # id(consumer) -> (consumer, its own timeout)
        self._until = 0.0  # monotonic ms
        self._lock = threading.Lock()
        # A greenlet under gevent: it writes the consumers' fields, which
        # the hub's greenlets read (and an actor that holds the hub only
        # delays the restore).
        self._timer = BackgroundThread(name="dramatiq-unique-handoff", loop=self._expire, on_fork=self._saved.clear)

    def consumer_booted(self, thread: Any) -> None:
        """Remember a consumer thread of this worker (``after_consumer_thread_boot``)."""
        queue = getattr(thread, "queue_name", None)
        if isinstance(queue, str) and queue == q_name(queue):
            self._threads[queue] = thread

    def handed_over(self, queue_name: str) -> None:
        """A message of ``queue_name`` was just handed a key."""
        consumer: Any = getattr(self._threads.get(q_name(queue_name)), "consumer", None)
        if redis_consumer_backoff(consumer) is None:
            return
        with self._lock:
            self._until = now_ms() + self.hold
            backoff = redis_consumer_backoff(consumer)  # read under the lock that guards its writes
            if id(consumer) not in self._saved and backoff is not None:
                self._saved[id(consumer)] = (consumer, backoff)
                set_redis_consumer_backoff(consumer, min(backoff, self.poll))
        if self._timer.running_in != pid():
            self._timer.ensure_started()

    def _expire(self, timer: BackgroundThread) -> None:
        """Restore the consumers' backoff once no hand-off came for
        ``hold`` ms.  The thread stays, asleep, for the next hand-off:
        one that ended could miss a hand-off made as it ended.
        """
        while not timer.stopping:
            with self._lock:
                left = self._until - now_ms()
                if left <= 0:
                    self._restore()
                    left = self.hold  # nothing to restore: look again, asleep, a hold later
            timer.wait(left)

    def _restore(self) -> None:
        for consumer, backoff in self._saved.values():
            set_redis_consumer_backoff(consumer, backoff)
        self._saved.clear()

    def stop(self) -> None:
        """Give every consumer its own backoff back."""
        self._timer.stop()
        with self._lock:
            self._restore()
