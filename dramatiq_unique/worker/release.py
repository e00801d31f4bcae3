"""Releasing the locks of a delivery when its run ends (:class:`Unlocker`): through the
:class:`Releaser` when the backend batches releases, else straight to the backend; failed ones
are sent again by :class:`~.resend.FailedReleases`.  See docs/reliability.md, "The releaser".
"""

from __future__ import annotations

import threading
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Sequence

from dramatiq import Message

from ..backends.capabilities import BatchedReleases
from ..backends.records import Release, Start
from ..background import BackgroundThread, Served, now_ms, pid
from ..model.wire import UNIQUE_RESCHEDULES
from ..send.context import LockContext
from .leases import (
    Delivery,
    FollowUp,
    HandOff,
    HandoffPolls,
    LeaseKeeper,
    LockToRelease,
    Outcome,
    PendingRelease,
    ReleaseReports,
    set_fence,
)
from .resend import FailedRelease, FailedReleases, LandedReports, LockTroubles

if TYPE_CHECKING:
    from dramatiq import Broker
    from dramatiq.broker import MessageProxy

#: The most releases sent in one round trip.
DEFAULT_BATCH = 256

#: After how many ms a batch still waiting for its reply is reported.
DEFAULT_STALL_AFTER = 1_000

#: How long, in ms, the worker's shutdown waits for pending releases.
DEFAULT_DRAIN_TIMEOUT = 10_000

#: How long, in ms, a release waits for a run lock call to carry it.
DEFAULT_LINGER = 2

#: Ms without a submission after which the releaser waits to be woken, not looking every ``linger``.
QUIET_AFTER = 50


class Releaser(Served[BatchedReleases, ReleaseReports, PendingRelease]):
    """Releases run locks of one process in the background.  ``on_stalled`` is called, on a worker
    thread, with a batch that waited past ``stall_after``; durations are in ms, and a ``linger`` of 0
    sends every release at once.
    """

    def __init__(
        self,
        backend: BatchedReleases,
        *,
        reports: ReleaseReports,
        on_stalled: Callable[[list[PendingRelease]], None],
        batch: int = DEFAULT_BATCH,
        stall_after: int = DEFAULT_STALL_AFTER,
        drain_timeout: int = DEFAULT_DRAIN_TIMEOUT,
        linger: int = DEFAULT_LINGER,
    ) -> None:
        self.on_stalled = on_stalled
        self.batch = batch
        self.stall_after = stall_after
        self.linger = linger
        # An older module's name: operators filter on it.
        super().__init__(
            backend,
            reports=reports,
            drain_timeout=drain_timeout,
            logger="dramatiq_unique.worker.releaser",
            name="dramatiq-unique-releaser",
        )

    def _reset(self) -> None:
        # Also in a forked child: the parent releases what it queued, and its lock may have been held.
        self._pending: list[PendingRelease] = []
        self._sending: list[PendingRelease] = []
        self._riding = 0  # releases sent by worker threads, not yet reported
        self._draining = 0  # drains waiting: the releaser lingers for none
        self._last_submitted = 0.0
        self._follow_ups: list[FollowUp] = []  # what reports left to do, on the releaser thread
        self._sending_since = 0.0
        self._stall_reported = False
        # Per-job paths take the plain lock, skipping the condition's Python-level __enter__.
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._idle = False

    def submit(self, pending: PendingRelease) -> None:
        """Queue one release; never waits for the backend."""
        with self._lock:
            self._pending.append(pending)
            self._last_submitted = pending.submitted_at
            if self._thread.running_in != pid():
                self._ensure_thread()
            if self._idle:
                self._wakeup.notify()  # only an idle releaser needs waking; a busy one looks again
            stalled = self._stalled() if self._sending else None
        if stalled:
            self.on_stalled(stalled)

    def take_run_lock(self, key: str, owner: str, **start: Any) -> Start:
        """Take a run lock (:meth:`LockBackend.start`), the pending releases riding in front; they fail with it."""
        riders = self._board()
        if not riders:
            return self.backend.start(key, owner, **start)
        try:
            outcomes, started = self.backend.release_and_start(
                [pending.releasing() for pending in riders], key, owner, **start
            )
        except Exception as e:
            outcomes, started = [e] * len(riders), e
        except BaseException:
            self._unboard(riders)
            raise
        # Reported here, in order; their hand-offs go to the releaser thread.
        self._settled(len(riders), self._reports(riders, outcomes))
        if isinstance(started, Exception):
            raise started
        return started

    def release_now(self, pending: PendingRelease) -> None:
        """Send one release now, the pending riding in front, and hand over here: a waiter likely
        waits.  What an interrupt of this thread broke is left to the releaser thread.
        """
        with self._lock:
            riders, self._pending = self._pending[: self.batch - 1] + [pending], self._pending[self.batch - 1 :]
            self._riding += len(riders)
        try:
            outcomes: list[Outcome] = list(self.backend.release_many([rider.releasing() for rider in riders]))
        except Exception as e:
            outcomes = [e] * len(riders)
        except BaseException:
            self._unboard(riders)
            raise
        follow_ups = self._reports(riders, outcomes)
        try:
            while follow_ups:
                self._hand_over(*follow_ups[0])
                del follow_ups[0]
        finally:
            # An interrupted hand-off is done again there: one enqueued twice is skipped as a copy that lost.
            self._settled(len(riders), follow_ups)

    def _board(self) -> list[PendingRelease]:
        if not self._pending:
            return []  # read without the lock: a release missed here goes with the next call
        with self._lock:
            riders, self._pending = self._pending[: self.batch], self._pending[self.batch :]
            self._riding += len(riders)
        return riders

    def _unboard(self, riders: list[PendingRelease]) -> None:
        """Queue again, first, for the releaser thread, the releases of a call that a time limit or a
        shutdown notice broke (it may have applied them).
        """
        for pending in riders:
            pending.resent = True
        with self._lock:
            self._pending[:0] = riders
            self._riding -= len(riders)
            self._ensure_thread()
            self._wakeup.notify_all()

    def _reports(self, riders: Sequence[PendingRelease], outcomes: Sequence[Outcome]) -> list[FollowUp]:
        follow_ups: list[FollowUp] = []
        for pending, outcome in zip(riders, outcomes):
            handoff = self._report(pending, outcome)
            if handoff is not None:
                follow_ups.append((pending, handoff))
        return follow_ups

    def _settled(self, carried: int, follow_ups: list[FollowUp]) -> None:
        """``carried`` releases of a worker thread are reported; ``follow_ups`` go to the releaser."""
        with self._lock:
            self._riding -= carried - len(follow_ups)  # a hand-off counts until it is done
            self._follow_ups += follow_ups
            if follow_ups:
                self._ensure_thread()
            if follow_ups or self._draining:
                self._wakeup.notify_all()

    def _stalled(self) -> list[PendingRelease]:
        """The batch in flight, once, when it has waited too long."""
        if not self._sending or self._stall_reported or now_ms() - self._sending_since < self.stall_after:
            return []
        self._stall_reported = True
        return list(self._sending)

    def pending(self) -> int:
        """How many releases are queued, in flight or not yet reported."""
        with self._wakeup:
            return self._left()

    def _left(self) -> int:
        return len(self._pending) + len(self._sending) + self._riding

    def drain(self, timeout: Optional[float] = None) -> bool:
        """Wait until every release was sent and reported, at most ``timeout`` ms; True when none is left."""
        deadline = now_ms() + (self.drain_timeout if timeout is None else timeout)
        with self._wakeup:
            self._draining += 1
            self._wakeup.notify_all()  # a lingering releaser sends at once
            try:
                while self._left():
                    if self._thread.running_in != pid() and not self._riding:
                        return False
                    left = deadline - now_ms()
                    if left <= 0:
                        return False
                    self._wakeup.wait(timeout=left / 1000)
            finally:
                self._draining -= 1
        return True

    def _left_over(self) -> list[PendingRelease]:
        # Also left in place: a stuck call that returns in time still sends them (twice is harmless).
        return list(self._sending) + list(self._pending)

    def _send(self, batch: list[PendingRelease], follow_ups: list[FollowUp]) -> None:
        """Do the hand-offs left to do, then send ``batch`` and report each outcome."""
        for pending, handoff in follow_ups:
            self._hand_over(pending, handoff)
        outcomes = self._release(batch)
        for pending, outcome in zip(batch, outcomes):
            then = self._report(pending, outcome)
            if then is not None:
                self._hand_over(pending, then)
        with self._wakeup:
            self._sending = []
            self._riding -= len(follow_ups)
            self._wakeup.notify_all()

    def _next(self, thread: BackgroundThread) -> Optional[tuple[list[PendingRelease], list[FollowUp]]]:
        """Wait, locked, for hand-offs or releases no worker carried within ``linger``; None to end."""
        while True:
            follow_ups, self._follow_ups = self._follow_ups, []
            batch = self._due(force=bool(follow_ups) or thread.stopping or self._draining > 0)
            if batch or follow_ups:
                self._sending, self._sending_since, self._stall_reported = batch, now_ms(), False
                return batch, follow_ups
            if thread.stopping and not self._pending:
                return None
            # Idle (woken by a submission): nothing to send, and nothing to linger for or nothing lately.
            self._idle = not self._pending and (self.linger <= 0 or now_ms() - self._last_submitted > QUIET_AFTER)
            look_again = self._linger_left() if self._pending else self.linger
            self._wakeup.wait(timeout=1.0 if self._idle else look_again / 1000)
            self._idle = False

    def _due(self, *, force: bool) -> list[PendingRelease]:
        if not self._pending or not (force or self._linger_left() <= 0):
            return []
        batch, self._pending = self._pending[: self.batch], self._pending[self.batch :]
        return batch

    def _linger_left(self) -> float:
        first = self._pending[0]
        return 0.0 if first.resent else first.submitted_at + self.linger - now_ms()

    def _release(self, batch: list[PendingRelease]) -> list[Outcome]:
        if not batch:
            return []
        try:
            outcomes = self.backend.release_many([pending.releasing() for pending in batch])
        except Exception as e:
            return [e] * len(batch)
        if self._stall_reported:
            self.logger.warning(
                "The lock backend answered %d release(s) after %.0f ms.", len(batch), now_ms() - self._sending_since
            )
        return outcomes

    def _report(self, pending: PendingRelease, outcome: Outcome) -> Optional[HandOff]:
        if pending.resent and isinstance(outcome, Release) and not outcome.held and outcome.promoted is None:
            return None  # the broken call released it: nothing was lost
        try:
            return self.reports.released(pending, outcome)
        except Exception:
            self.logger.exception("Could not report the release of %r.", pending.key)
            return None

    def _hand_over(self, pending: PendingRelease, handoff: HandOff) -> None:
        try:
            self.reports.hand_over(handoff)
        except Exception:
            self.logger.exception("Could not report the release of %r.", pending.key)


class Unlocker:
    """Releases the locks of each delivery of one middleware; tells lost locks to ``troubles``."""

    #: The worker's background tasks, reporting back here; set by the middleware.
    threads: "Threads"

    def __init__(self, service: LockContext, *, troubles: LockTroubles) -> None:
        self.service = service
        self.troubles = troubles

    def end_run(self, broker: "Broker", message: "MessageProxy", state: Delivery, *, succeeded: bool) -> None:
        """Release the run lock, once, and hand the key to its longest waiter.  ``succeeded``: the
        run finishes its message (a failed run never does, whatever becomes of its retry).
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
        slot = self.service.reserve(lock.spec)
        if releaser is not None:
            actor = lock.spec.actor_name
            pending = PendingRelease(lock.key, lock.owner, actor, lock, succeeded=succeeded, reserve=slot)
            # A message that waited likely leaves waiters, the next waiting for this: no lingering.
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
        """Release the enqueue lock, once, if the lock type frees it; ``strict`` raises (to retry)."""
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
        """Report the release of an enqueue lock, ``held`` until then or not."""
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
        """Report a release the releaser sent (see :class:`~.leases.ReleaseReports`)."""
        return self._report(pending.lock, outcome) if pending.lock is not None else None

    def _report(self, lock: LockToRelease, outcome: Outcome) -> Optional[HandOff]:
        """Report a run lock's release, queue a failed one again; return its hand-off, if any."""
        service, lease = self.service, lock.lease
        if isinstance(outcome, Exception):
            service.backend_error("release", lock.key, lock.spec, lock.message, outcome)
            until = lease.expires_at if lease is not None else now_ms() + service.settings.lease
            self.threads.failed.submit(FailedRelease(lock.key, lock.owner, until, lock, succeeded=lock.succeeded))
            return None
        if outcome.held:
            service.emit("released", lock.spec, lock.key, lock.message)
        elif lock.confirmed and (lease is None or not lease.lost):
            self.troubles.lost(lock.spec.actor_name, lock.key, lock.owner)
        return _handoff(lock, outcome)

    def landed(self, failed: FailedRelease, outcome: Release) -> Optional[HandOff]:
        """Report a release that landed on a retry: an owner found gone is no lost lock."""
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
    if outcome.promoted is None or lock.broker is None:
        return None
    return HandOff(lock.broker, lock.key, outcome.promoted)


class Reports(ReleaseReports, LandedReports, Protocol):
    """Where the releaser and the retries of failed releases report."""


class Threads(Protocol):
    """The worker's background tasks releases use (the middleware's ``WorkerThreads``)."""

    handoffs: HandoffPolls

    @property
    def leases(self) -> LeaseKeeper: ...

    @property
    def releaser(self) -> Optional[Releaser]: ...

    @property
    def failed(self) -> FailedReleases: ...

    @property
    def take_run_lock(self) -> Callable[..., Start]: ...
