"""Lifecycle events: what happened to which lock, for listeners,
counters and metrics; and the log lines that tell the same story.

Subscribe a callable taking a :class:`LockEvent`, when the middleware
is built or later::

  def on_lock_event(event: LockEvent) -> None:
      if event.name == "lock_lost":
          alert(f"{event.actor}: {event.key} lost by {event.message_id}")

  unique = UniqueMiddleware(listeners=[on_lock_event])
  # or, on a middleware built elsewhere:
  unique.events.subscribe(on_lock_event)

Listeners run on the thread where the event happened (the sender's, a
worker thread, the lease renewal thread for ``lock_lost``, or the
releaser thread for a run lock's ``released``), so they
must be quick and thread-safe.  One that raises is logged and ignored.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

from dramatiq.logging import get_logger

#: Every event name, in the order a lock meets them.
EVENTS = (
    "locked",  # a lock or lease was taken
    "duplicate",  # a send was refused: its key was held (client conflict)
    "conflict",  # a delivery met a held run lock and was dropped, failed or dead-lettered
    "rescheduled",  # a delivery met a held run lock and was re-enqueued for later
    "superseded",  # a delivery was skipped: a newer send replaced its message (replace, debounce)
    "skipped",  # a copy of a message did not run: another copy of the same message runs
    "released",  # a lock was released by its owner
    "lock_lost",  # a lock expired or was taken before its owner released it
    "backend_error",  # the lock backend failed, including a failed lease renewal
)


class LogLine(NamedTuple):
    """One line of :data:`LOG_LINES`."""

    level: str
    logger: str
    template: str
    meaning: str


_MIDDLEWARE = "dramatiq_unique.middleware.UniqueMiddleware"
_OWED = "dramatiq_unique.worker.resend.OwedReleases"

#: Every line the middleware logs while it enqueues and runs messages.
#: Levels and templates are stable: filter and alert on them.  An
#: ordinary duplicate is INFO; a message dropped, or a lock that lapsed,
#: is WARNING; a lost run lock or a failing backend is ERROR.
LOG_LINES: tuple[LogLine, ...] = (
    LogLine(
        "DEBUG",
        "dramatiq_unique.model.spec",
        "Digest %s of %s is made of %s.",
        "the inputs of a digest, to answer why two sends share a key",
    ),
    LogLine(
        "DEBUG",
        _MIDDLEWARE,
        "Moved UniqueMiddleware before %s.",
        "worker boot placed the middleware before AgeLimit, TimeLimit and Retries",
    ),
    LogLine(
        "DEBUG",
        _MIDDLEWARE,
        "Moved %s before UniqueMiddleware.",
        "worker boot placed Prometheus first, so it counts the deliveries the middleware skips",
    ),
    LogLine(
        "DEBUG",
        _MIDDLEWARE,
        "Rescheduled %s: run lock %r is held.",
        "a delivery met a held run lock and will be tried again (event rescheduled)",
    ),
    LogLine(
        "DEBUG",
        _MIDDLEWARE,
        "Skipped %s: %s.",
        "a copy of a rescheduled message did not run because another copy of it runs (event skipped)",
    ),
    LogLine(
        "DEBUG",
        _MIDDLEWARE,
        "Rescheduled %s again: it is still in line for run lock %r.",
        "a delayed copy of a waiting message came back before its turn, and comes back later (event rescheduled)",
    ),
    LogLine(
        "INFO",
        _MIDDLEWARE,
        "Skipped %s: it duplicates run %s of message %s, which succeeded (lock %r).",
        "a copy of a message whose run succeeded came again (a broker's duplicate, or a replay within 10 "
        "minutes of a message that once waited) and did not run (event skipped, reason done)",
    ),
    LogLine(
        "DEBUG",
        _MIDDLEWARE,
        "Re-enqueued %s without its lock %r: %s.",
        "a retry or delay-queue move of a copy that will be skipped did not take the enqueue lock back",
    ),
    LogLine(
        "WARNING",
        "dramatiq_unique.send.context",
        "Could not store why %s did not run: %r",
        "the Results backend failed to store the conflict that ended a message; its caller times out",
    ),
    LogLine(
        "INFO",
        _MIDDLEWARE,
        "Duplicate %s not enqueued: lock %r is held by message %s.",
        "a send was refused as a duplicate (event duplicate, client strategy log)",
    ),
    LogLine(
        "DEBUG",
        _MIDDLEWARE,
        "Message %s replaced message %s as holder of %r.",
        "a send superseded the current message of its key (client strategy replace, debounce)",
    ),
    LogLine(
        "INFO",
        _MIDDLEWARE,
        "Skipped %s: message %s superseded it (lock %r).",
        "a copy of a superseded message was delivered and skipped: not run, not retried (event superseded)",
    ),
    LogLine(
        "INFO",
        _MIDDLEWARE,
        "Message %s is current again in %r: its replacement was not enqueued.",
        "the broker failed to publish a replacing send, so the message it superseded runs after all",
    ),
    LogLine(
        "INFO",
        _MIDDLEWARE,
        "Released %r: its message was not enqueued.",
        "the broker failed to publish, so the lock the send took was given back",
    ),
    LogLine(
        "WARNING",
        _MIDDLEWARE,
        "Dropping %s: run lock %r is held by message %s.",
        "a delivery was dropped (event conflict, server strategy log)",
    ),
    LogLine(
        "WARNING",
        _MIDDLEWARE,
        "Dead-lettering %s: run lock %r is held by message %s.",
        "a delivery was dead-lettered (event conflict, server strategy reject)",
    ),
    LogLine(
        "WARNING",
        _MIDDLEWARE,
        "Lock %r of %s lapsed and is held by %s; enqueueing it anyway.",
        "a retry or delayed message outlived its enqueue lock, which another send took (event lock_lost)",
    ),
    LogLine(
        "WARNING",
        _MIDDLEWARE,
        "Lock %r of message %s lapsed before it was released: raise its lock_ttl.",
        "an enqueue lock expired while its message waited or ran (event lock_lost)",
    ),
    LogLine(
        "WARNING",
        _MIDDLEWARE,
        "Enqueueing %s without its lock %r.",
        "on_backend_error=run_unlocked: the backend failed and the send went ahead unlocked",
    ),
    LogLine(
        "WARNING",
        _MIDDLEWARE,
        "Running %s without its lock %r.",
        "on_backend_error=run_unlocked: the backend failed and the actor runs unlocked",
    ),
    LogLine(
        "WARNING",
        _MIDDLEWARE,
        "Could not hand %r to its next waiter (%r); it runs after its delay.",
        "the broker refused the promoted waiter; its rescheduled copy still runs",
    ),
    LogLine(
        "ERROR",
        _MIDDLEWARE,
        "Lock backend %s has not answered %d release(s) for %.0f ms; the keys stay held until it does "
        "or their leases expire.",
        "a batch of run-lock releases waited longer than a second for Redis; worker threads go on "
        "(event backend_error per lock)",
    ),
    LogLine(
        "WARNING",
        "dramatiq_unique.worker.releaser.Releaser",
        "The lock backend answered %d release(s) after %.0f ms.",
        "a batch reported as stalled was answered at last; its outcomes follow as usual",
    ),
    LogLine(
        "ERROR",
        "dramatiq_unique.worker.releaser.Releaser",
        "Could not report the release of %r.",
        "a bug: reporting a finished release raised (the traceback follows)",
    ),
    LogLine(
        "DEBUG",
        "dramatiq_unique.worker.resend.FailedReleases",
        "Sending the release of %r again failed too: %r",
        "a release that failed is still failing; it is sent again with backoff (at most every second)",
    ),
    LogLine(
        "WARNING",
        "dramatiq_unique.worker.resend.FailedReleases",
        "Gave up releasing %r: it has expired by itself.",
        "a failed release was retried until its lock's lease or lock_ttl ran out: the key is free",
    ),
    LogLine(
        "WARNING",
        _OWED,
        "%d release(s) could not be sent before shutdown: they were written to queue %r, and the next "
        "worker makes them.",
        "the worker stopped while the lock backend did not answer (see docs/reliability.md, \"Graceful "
        "shutdown within a bound\")",
    ),
    LogLine(
        "ERROR",
        _OWED,
        "Lock %r of %s could not be released before shutdown, and %s: it expires by itself, or "
        "`dramatiq-unique release` frees it.",
        "neither the lock backend nor the broker took a release the stopping worker owed: the key stays held "
        "until its lease or lock_ttl runs out",
    ),
    LogLine(
        "DEBUG",
        _OWED,
        "Could not write owed releases to the broker: %r",
        "the stopping worker tries again, every 100 ms, within its shutdown_timeout",
    ),
    LogLine(
        "DEBUG",
        _OWED,
        "An owed release of %r failed again: %r",
        "the lock backend still refuses a release a stopped worker owed; it is enqueued again with backoff",
    ),
    LogLine(
        "INFO",
        _OWED,
        "Made %d release(s) owed by a worker that stopped.",
        "a worker made the releases that a stopped worker wrote to the broker",
    ),
    LogLine(
        "WARNING",
        _OWED,
        "Gave up releasing %r: it has expired by itself.",
        "an owed release was retried until its lock's lock_ttl ran out: the key is free",
    ),
    LogLine(
        "WARNING",
        _OWED,
        "Could not hand %r to its next waiter (%r); it runs after its delay.",
        "an owed release handed the key to a waiter, and the broker refused it; its rescheduled copy still runs",
    ),
    LogLine(
        "WARNING",
        "dramatiq_unique.worker.leases.LeaseKeeper",
        "gevent patched threads, and %s gives no connection for a native thread: leases renew on the hub, "
        "and an actor that blocks it for longer than the lease loses its lease.",
        "under gevent with a backend that has no native renewer (stub, Cluster, TLS, Sentinel): see "
        "docs/reliability.md, \"Green threads\"",
    ),
    LogLine(
        "WARNING",
        "dramatiq_unique.worker.leases.LeaseKeeper",
        "Could not renew %d lease(s): %r. Trying again.",
        "lease renewal failed; it is retried every second until the lease runs out (event backend_error)",
    ),
    LogLine(
        "ERROR",
        _MIDDLEWARE,
        "Message %s is still running after it was interrupted: its run lock %r is kept until it ends.",
        "an async actor ignored its time limit's cancellation; the lock is released when its coroutine ends",
    ),
    LogLine(
        "ERROR",
        _MIDDLEWARE,
        "Lock %r was lost: message %s no longer holds it (its lease expired or it was taken over).",
        "a running message lost its run lock; another may run alongside it (event lock_lost)",
    ),
    LogLine(
        "ERROR",
        _MIDDLEWARE,
        "Lock backend %s failed to %s %r: %r",
        "the backend failed to take or release a lock (event backend_error)",
    ),
    LogLine(
        "ERROR",
        _MIDDLEWARE,
        "Enqueueing %s without its lock: it could not be re-entered.",
        "a re-enqueue (retry, delay-queue move) failed to re-enter its lock; it goes on, never lost",
    ),
    LogLine(
        "ERROR",
        _MIDDLEWARE,
        "Could not release %r after a failed enqueue: %r",
        "the backend failed while giving back the lock of an unpublished send (event backend_error)",
    ),
    LogLine(
        "WARNING",
        "dramatiq_unique.send.confirm.Confirmer",
        "Could not confirm %d enqueue lock(s): %r. Trying again.",
        "confirming provisional enqueue locks failed; retried until their provisional window ends",
    ),
    LogLine(
        "WARNING",
        "dramatiq_unique.send.confirm.Confirmer",
        "Dropped %d lock(s) waiting for confirmation: they lapse after the provisional window.",
        "more than 100,000 enqueue locks waited for confirmation (the backend is failing)",
    ),
    LogLine(
        "ERROR",
        "dramatiq_unique.send.confirm.Confirmer",
        "Enqueue lock %r of message %s lapsed before it could be confirmed; its key is free again.",
        "a published message's enqueue lock could not be confirmed in its provisional window (event lock_lost)",
    ),
    LogLine(
        "ERROR",
        _MIDDLEWARE,
        "Could not queue %d enqueue lock(s) for confirmation: %r; they lapse after the provisional window.",
        "a published message's lock could not be handed to the confirmer, e.g. at interpreter shutdown",
    ),
    LogLine(
        "ERROR",
        _MIDDLEWARE,
        "Lock backend %s does not answer at worker boot (%s); the worker goes on, and until it answers, "
        "on_backend_error=%r decides what locked messages do.",
        "the worker booted with a lock backend it cannot reach (an unknown host, a closed port): the line names "
        "the backend and the reason",
    ),
    LogLine(
        "WARNING",
        _MIDDLEWARE,
        "reap_interval is set, but a %s cannot look messages up by id: no periodic reaper.",
        "the periodic reaper needs the Redis broker",
    ),
    LogLine(
        "WARNING",
        "dramatiq_unique.worker.reap.PeriodicReaper",
        "Reaped enqueue lock %r of message %s: its message is in no queue.",
        "the periodic reaper released a lock whose message vanished from the broker",
    ),
    LogLine(
        "WARNING",
        "dramatiq_unique.worker.reap.PeriodicReaper",
        "Reaper pass failed: %r.",
        "a periodic reaper pass failed; the next one runs after the interval",
    ),
    LogLine(
        "ERROR",
        "dramatiq_unique.events.EventHub",
        "Lock event listener %r failed on %r.",
        "a listener raised; locking went on",
    ),
)


@dataclass(frozen=True)
class LockEvent:
    """One thing that happened to a lock.

    Attributes:
      name(str): One of :data:`EVENTS`.
      actor(str): The actor's name.
      key(str): The lock key.
      message_id(str): The message concerned.
      holder(str): For conflicts, the message id of the holder; for a
        ``skipped`` duplicate of a run that succeeded, that run's lock
        owner (``<message id>/<token>``).
      reason(str): For ``skipped``, why: ``"done"`` (a duplicate of a
        run that succeeded), ``"stale"`` or ``"lost"`` (see
        :class:`~dramatiq_unique.backends.records.CopyVerdict`).
    """

    name: str
    actor: str
    key: str
    message_id: Optional[str] = None
    holder: Optional[str] = None
    reason: Optional[str] = None


Listener = Callable[[LockEvent], None]


class EventHub:
    """Counts events and passes them to listeners.  A failing listener
    is logged and never breaks locking.
    """

    def __init__(self) -> None:
        self.logger = get_logger(__name__, type(self))
        self._mutex = threading.Lock()
        self._listeners: list[Listener] = []
        # One counter per (event, actor): ``next()`` on it is one C call,
        # atomic under the GIL, so counting takes no lock.
        self._counters: dict[tuple[str, str], itertools.count[int]] = {}

    def subscribe(self, listener: Listener) -> Listener:
        """Call ``listener`` with every :class:`LockEvent`.  Usable as a
        decorator.
        """
        with self._mutex:
            self._listeners = [*self._listeners, listener]
        return listener

    def unsubscribe(self, listener: Listener) -> None:
        with self._mutex:
            self._listeners = [known for known in self._listeners if known is not listener]

    def count(self, name: str, actor: Optional[str] = None) -> int:
        """How many ``name`` events happened, for one actor or all."""
        counters = list(self._counters.items())  # one C call: a snapshot, beside concurrent tallies
        return sum(_value(counter) for (event, who), counter in counters if event == name and actor in (None, who))

    def emit(self, event: LockEvent) -> None:
        self.tell(self.tally(event.name, event.actor), event)

    def tally(self, name: str, actor: str) -> list[Listener]:
        """Count one event; return the listeners to tell of it, so that
        a caller builds the event only when someone listens.
        """
        counter = self._counters.get((name, actor))
        if counter is None:  # setdefault is atomic: of two first tallies, both count on the one it keeps
            counter = self._counters.setdefault((name, actor), itertools.count())
        next(counter)
        return self._listeners

    def tell(self, listeners: list[Listener], event: LockEvent) -> None:
        """Pass ``event`` to ``listeners``, as :meth:`tally` returned them."""
        for listener in listeners:
            try:
                listener(event)
            except Exception:
                self.logger.exception("Lock event listener %r failed on %r.", listener, event)


def _value(counter: "itertools.count[int]") -> int:
    """How many times ``next()`` was called on a ``count()``: what its
    repr, ``count(N)``, shows (the one reading of it that is neither
    deprecated nor moves it).
    """
    return int(repr(counter)[len("count(") : -1])
