"""Releases sent again: failed ones, until they land (:class:`FailedReleases`), and those a
stopping worker owes, which the next one makes (:class:`OwedReleases`).  See
docs/reliability.md, "Failed releases" and "Graceful shutdown within a bound".
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Union

import dramatiq
from dramatiq import Message
from dramatiq.logging import get_logger

from ..backends.base import LockBackend
from ..backends.records import Release
from ..background import JITTER, BackgroundThread, OneCall, Served, now_ms, pid
from ..events import LockEvent
from ..model.wire import message_id_of
from ..send.context import RESERVE_DELAYS, RESERVE_SLACK, LockContext
from ..settings import MAX_DURATION
from .leases import HandOff, Lease, LockToRelease, PendingRelease

if TYPE_CHECKING:
    from dramatiq import Broker

#: Ms before the first retry of a failed release; each waits twice as long, up to DEFAULT_MOST_BETWEEN.
DEFAULT_FIRST_RETRY = 100

#: The longest wait between retries, in ms: a key is free about this soon after the network is back.
DEFAULT_MOST_BETWEEN = 1_000

#: How long, in ms, the worker's shutdown waits for them.
DEFAULT_DRAIN_TIMEOUT = 5_000

#: The most releases sent in one round trip.
BATCH = 256

#: How a run lock's key ends (``LockContext.key(..., "run")``).
RUN_SUFFIX = ":run"


@dataclass(eq=False)
class FailedRelease:
    """One release to send again, until monotonic ms ``until``, when the lock expires by itself.
    ``succeeded``: the release finishes its message (see ``LockBackend.release``).
    """

    key: str
    owner: str
    until: float
    lock: Optional[LockToRelease] = None
    due: float = 0.0
    wait: float = DEFAULT_FIRST_RETRY
    succeeded: bool = False

    @property
    def options(self) -> dict[str, Any]:
        """The release call's keyword arguments, for :class:`OwedReleases`."""
        return {"succeeded": self.succeeded}


class LandedReports(Protocol):
    """Where :class:`FailedReleases` reports, on its thread: ``landed``, then its hand-off."""

    def landed(self, failed: FailedRelease, outcome: Release) -> Optional[HandOff]: ...

    def hand_over(self, handoff: HandOff) -> None: ...


class FailedReleases(Served[LockBackend, "LandedReports", FailedRelease]):
    """Sends failed releases of one process again, in the background (``first_retry``, ``most_between``,
    ``drain_timeout``: see their ``DEFAULT_*``).  ``record_ttl`` is how long past its lease a run lock's
    release is still sent, in ms (0: not at all); the middleware passes ``lock_ttl``, the life of a
    message record.
    """

    def __init__(
        self,
        backend: LockBackend,
        *,
        reports: LandedReports,
        first_retry: int = DEFAULT_FIRST_RETRY,
        most_between: int = DEFAULT_MOST_BETWEEN,
        drain_timeout: int = DEFAULT_DRAIN_TIMEOUT,
        record_ttl: int = 0,
    ) -> None:
        self.record_ttl = record_ttl
        self.first_retry = first_retry
        self.most_between = most_between
        name = "dramatiq-unique-release-retries"
        super().__init__(backend, reports=reports, drain_timeout=drain_timeout, logger=__name__, name=name)

    def _reset(self) -> None:
        # Also in a forked child: the parent's failures are its own, and its lock may have been held.
        self._failed: list[FailedRelease] = []
        self._sending = 0
        self._stuck: list[FailedRelease] = []  # the batch in flight, until its outcome is known
        self._wakeup = threading.Condition(threading.Lock())

    def submit(self, failed: FailedRelease) -> None:
        """Queue a release that failed; never waits for the backend."""
        failed.wait = self.first_retry
        failed.due = now_ms() + self._jittered(failed.wait)
        if failed.key.endswith(RUN_SUFFIX):
            failed.until += self.record_ttl
        with self._wakeup:
            self._failed.append(failed)
            if self._thread.running_in != pid():
                self._ensure_thread()
            self._wakeup.notify_all()

    def pending(self) -> int:
        """How many releases wait for a retry, or are being sent."""
        with self._wakeup:
            return len(self._failed) + self._sending

    def step(self, *, force: bool = False) -> None:
        """Send the releases due now (``force``: all) in one round trip; report or queue again each."""
        with self._wakeup:
            batch = self._take_due(force=force)
        if batch:
            self._send(batch)

    def drain(self, timeout: Optional[float] = None) -> bool:
        """Retry, on the calling thread, until nothing is left, at most ``timeout`` ms; True if so."""
        deadline = now_ms() + (self.drain_timeout if timeout is None else timeout)
        while self.pending():
            if now_ms() >= deadline:
                return False
            self.step(force=True)
            with self._wakeup:
                if self._failed or self._sending:
                    self._wakeup.wait(timeout=min(self.first_retry, max(deadline - now_ms(), 0)) / 1000)
        return True

    def _left_over(self) -> list[FailedRelease]:
        left, self._failed = self._failed + self._stuck, []
        self._stuck = []
        now = now_ms()
        return [failed for failed in left if failed.until > now]

    def _next(self, thread: BackgroundThread) -> Optional[tuple[list[FailedRelease]]]:
        """Wait, holding the lock, for releases due; None to end."""
        while True:
            if thread.stopping or not self._failed:
                return None
            batch = self._take_due(force=False)
            if batch:
                return (batch,)
            if not self._failed:
                continue  # every one left had expired: the thread ends
            self._wakeup.wait(timeout=max(min(f.due for f in self._failed) - now_ms(), 1) / 1000)

    def _take_due(self, *, force: bool) -> list[FailedRelease]:
        now = now_ms()
        expired = [f for f in self._failed if f.until <= now]
        due = [f for f in self._failed if f.until > now and (force or f.due <= now)][:BATCH]
        self._failed = [f for f in self._failed if f not in expired and f not in due]
        self._sending += len(due)
        self._stuck += due
        for failed in expired:
            self.logger.warning("Gave up releasing %r: it has expired by itself.", failed.key)
        return due

    def _send(self, batch: list[FailedRelease]) -> None:
        try:
            locks = [(f.key, f.owner, f.succeeded) for f in batch]
            outcomes: list[Union[Release, Exception]] = self.backend.release_many(locks)
        except Exception as e:
            outcomes = [e] * len(batch)
        again = []
        for failed, outcome in zip(batch, outcomes):
            if isinstance(outcome, Exception):
                self.logger.debug("Sending the release of %r again failed too: %r", failed.key, outcome)
                failed.wait = min(failed.wait * 2, self.most_between)
                failed.due = now_ms() + self._jittered(failed.wait)
                again.append(failed)
            else:
                self._land(failed, outcome)
        with self._wakeup:
            self._failed += again
            self._sending -= len(batch)
            self._stuck = [f for f in self._stuck if f not in batch]
            self._wakeup.notify_all()

    def _land(self, failed: FailedRelease, outcome: Release) -> None:
        try:
            handoff = self.reports.landed(failed, outcome)
            if handoff is not None:
                self.reports.hand_over(handoff)
        except Exception:
            self.logger.exception("Could not report the release of %r.", failed.key)

    @staticmethod
    def _jittered(wait: float) -> float:
        return wait * JITTER.uniform(0.5, 1.0)


#: The internal actor that makes owed releases.
OWED_ACTOR = "dramatiq_unique_owed_releases"

#: Ms before the first retry of an owed release still refused; doubling up to OWED_MOST_BETWEEN.
OWED_FIRST_RETRY = 500

#: The longest wait between two retries, in milliseconds.
OWED_MOST_BETWEEN = 5_000

#: How often, in ms, a stopping process tries its enqueue again within its bound.
ENQUEUE_RETRY = 100

#: The most releases one message carries.
OWED_BATCH = 1_000


@dataclass(frozen=True)
class OwedRelease:
    """One release a stopping process could not send, made until Unix ms ``until``
    (when the lock expires by itself) with the release call's ``options``.
    """

    key: str
    owner: str
    until: int
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def within(cls, key: str, owner: str, left: float, options: Optional[dict[str, Any]] = None) -> "OwedRelease":
        """One whose lock expires ``left`` milliseconds from now."""
        return cls(key, owner, int(time.time() * 1000 + max(left, 0)), dict(options or {}))

    def encode(self) -> dict[str, Any]:
        return {"key": self.key, "owner": self.owner, "until": self.until, "options": self.options}

    @classmethod
    def decode(cls, data: dict[str, Any]) -> "OwedRelease":
        return cls(str(data["key"]), str(data["owner"]), int(data["until"]), dict(data.get("options") or {}))


#: The keywords an owed release may pass to ``release``, and what each must be.
_OWED_KEYWORDS: dict[str, Callable[[Any], bool]] = {
    "succeeded": lambda v: isinstance(v, bool),
    "reserve": lambda v: type(v) is int and 0 <= v <= RESERVE_DELAYS * MAX_DURATION + RESERVE_SLACK,  # as reserve()
}


class OwedReleases:
    """Writes what a stopping process owes, and makes what another owed, on ``service``'s backend
    (``first_retry``, ``most_between``: see :data:`OWED_FIRST_RETRY`, :data:`OWED_MOST_BETWEEN`).
    """

    def __init__(
        self,
        service: LockContext,
        *,
        first_retry: int = OWED_FIRST_RETRY,
        most_between: int = OWED_MOST_BETWEEN,
    ) -> None:
        self.logger = get_logger(__name__, type(self))
        self.service = service
        self.first_retry = first_retry
        self.most_between = most_between
        self.actor: Optional[dramatiq.Actor[Any, Any]] = None

    def declare(self, broker: "Broker", queue_name: str) -> None:
        """Declare the internal actor on ``queue_name``, a queue this worker consumes, unless declared."""
        if OWED_ACTOR in broker.actors:
            self.actor = broker.actors[OWED_ACTOR]
            return
        # Actor(), not @actor: its options are checked by no middleware.
        self.actor = dramatiq.Actor(self.make, broker=broker, actor_name=OWED_ACTOR, queue_name=queue_name,
                                    priority=0, options={})

    def write(self, owed: list[OwedRelease], *, timeout: float) -> bool:
        """Enqueue ``owed`` for the next worker, trying for at most ``timeout`` ms; True when all went.
        What could not be written is logged, key by key, and left to expire with its lock.
        """
        if not owed:
            return True
        if self.actor is None:
            self._unwritten(owed, "no queue of this worker runs a locked actor")
            return False
        deadline = now_ms() + timeout
        batches = [owed[i : i + OWED_BATCH] for i in range(0, len(owed), OWED_BATCH)]
        left: list[list[OwedRelease]] = []
        for batch in batches:
            if not self._enqueue_within(self._message(batch, attempt=0), deadline):
                left.append(batch)
        if left:
            self._unwritten([release for batch in left for release in batch], "the broker did not take them")
            return False
        self.logger.warning(
            "%d release(s) could not be sent before shutdown: they were written to queue %r, and the next "
            "worker makes them.", len(owed), self.actor.queue_name,
        )
        return True

    def _enqueue_within(self, message: Message[Any], deadline: float) -> bool:
        """Enqueue ``message``, again after a failure, until ``deadline``: a copy sent twice is harmless."""
        assert self.actor is not None
        while now_ms() < deadline:
            # On a daemon thread of its own: a broker that never answers holds that thread, not the shutdown.
            sending = OneCall(partial(self.actor.broker.enqueue, message), name="dramatiq-unique-owed")
            if not sending.done.wait(timeout=max(deadline - now_ms(), 0) / 1000):
                return False  # still sending: it may land, or not
            if sending.error is None:
                return True
            self.logger.debug("Could not write owed releases to the broker: %r", sending.error)
            time.sleep(min(ENQUEUE_RETRY, max(deadline - now_ms(), 0)) / 1000)
        return False

    def _unwritten(self, owed: list[OwedRelease], why: str) -> None:
        for release in owed:
            self.logger.error(
                "Lock %r of %s could not be released before shutdown, and %s: it expires by itself, or "
                "`dramatiq-unique release` frees it.", release.key, release.owner, why,
            )

    def _message(self, owed: list[OwedRelease], *, attempt: int) -> Message[Any]:
        assert self.actor is not None
        return self.actor.message_with_options(args=([release.encode() for release in owed],),
                                               kwargs={"attempt": attempt})

    def make(self, releases: list[dict[str, Any]], attempt: int = 0) -> None:
        """The actor: make each owed release; enqueue again, later, those the backend refused."""
        backend = self.service.locks
        assert self.actor is not None
        now = time.time() * 1000
        left, made = [], 0
        for release in map(self._decoded, releases):
            if release is None:
                continue
            if release.until <= now:
                self.logger.warning("Gave up releasing %r: it has expired by itself.", release.key)
                continue
            try:
                outcome = backend.release(release.key, release.owner, **release.options)
            except Exception as e:
                self.logger.debug("An owed release of %r failed again: %r", release.key, e)
                left.append(release)
                continue
            made += 1
            if outcome.promoted is not None:
                self._hand_over(release.key, outcome.promoted)
        if made:
            self.logger.info("Made %d release(s) owed by a worker that stopped.", made)
        if left:
            wait = min(self.first_retry * 2**attempt, self.most_between) * JITTER.uniform(0.5, 1.0)
            self.actor.broker.enqueue(self._message(left, attempt=attempt + 1), delay=int(wait))

    def _decoded(self, data: Any) -> Optional[OwedRelease]:
        """``data`` as an owed release, or None (logged) if it names a key or keyword not of this middleware."""
        try:
            release: Optional[OwedRelease] = OwedRelease.decode(data)
        except (AttributeError, KeyError, TypeError, ValueError):
            release = None
        if (
            release is None
            or not release.key.startswith(f"{self.service.settings.prefix}:")
            or not release.key.endswith((":run", ":queue"))
            or not all(_OWED_KEYWORDS.get(name, lambda _: False)(value) for name, value in release.options.items())
        ):
            self.logger.warning("Ignored an owed release that this package would not have written: %.200r", data)
            return None
        return release

    def _hand_over(self, key: str, encoded: bytes) -> None:
        assert self.actor is not None
        try:
            self.actor.broker.enqueue(Message.decode(encoded))
        except Exception as e:
            self.logger.warning("Could not hand %r to its next waiter (%r); it runs after its delay.", key, e)


class LockTroubles:
    """Logs and emits the lock troubles of one middleware."""

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
