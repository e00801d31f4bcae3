"""Releases run locks off the worker thread.

A worker thread that has run its actor hands the release of its run
lock to one daemon thread per process and moves on to its next
message.  The releaser sends every release pending at that moment in
one round trip (:meth:`LockBackend.release_many`), then reports each
outcome on its own thread, which also enqueues the message a release
handed the key to.

What stays true:

* Each release is submitted once, by the delivery that took the lock,
  and sent once; the release script checks the owner, so a release can
  never free another holder's slot.
* Nothing on a worker thread waits for Redis here: submitting appends
  to a list.  A batch that has waited longer than ``stall_after`` for
  its reply is reported (ERROR log and a ``backend_error`` per lock) by
  the next submission, so a stuck Redis is never silent.
* The lock is released a little later than the message is acked.  If
  the process dies in between, the key stays held until its lease
  expires (``lease``, 60 s by default), as after any crash.
* The worker's shutdown drains the pending releases, waiting at most
  ``drain_timeout``.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

from dramatiq.logging import get_logger

from .backend import LockBackend, Release

#: The most releases sent in one round trip.
DEFAULT_BATCH = 256

#: After how long, in milliseconds, a batch still waiting for its reply
#: is reported.
DEFAULT_STALL_AFTER = 1_000

#: How long, in milliseconds, the worker's shutdown waits for pending
#: releases.
DEFAULT_DRAIN_TIMEOUT = 10_000

Outcome = Union[Release, Exception]


def _now_ms() -> float:
    return time.monotonic() * 1000


@dataclass(eq=False)
class PendingRelease:
    """One run lock to release, and what to do with the outcome.

    Attributes:
      key(str): The lock key.
      owner(str): The owner token of the execution that held it.
      actor(str): The actor, for events.
      done(callable): Called on the releaser thread with the
        :class:`Release`, or the exception the release raised.
    """

    key: str
    owner: str
    actor: str
    done: Callable[[Outcome], None]
    submitted_at: float = field(default_factory=_now_ms)


class Releaser:
    """Releases run locks of one process in the background.

    Parameters:
      backend(LockBackend): Where the locks live.
      on_stalled(callable): Called, on a worker thread, with the
        releases of a batch that has waited longer than
        ``stall_after`` for the backend.
      batch(int): The most releases per round trip.
      stall_after(int): In milliseconds.
      drain_timeout(int): In milliseconds.
    """

    def __init__(
        self,
        backend: LockBackend,
        *,
        on_stalled: Callable[[list[PendingRelease]], None],
        batch: int = DEFAULT_BATCH,
        stall_after: int = DEFAULT_STALL_AFTER,
        drain_timeout: int = DEFAULT_DRAIN_TIMEOUT,
    ) -> None:
        self.logger = get_logger(__name__, type(self))
        self.backend = backend
        self.on_stalled = on_stalled
        self.batch = batch
        self.stall_after = stall_after
        self.drain_timeout = drain_timeout
        self._pending: list[PendingRelease] = []
        self._sending: list[PendingRelease] = []
        self._sending_since = 0.0
        self._stall_reported = False
        self._wakeup = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._pid = os.getpid()
        self._stopping = False
        self._idle = False

    def submit(self, pending: PendingRelease) -> None:
        """Queue one release; never waits for the backend."""
        with self._wakeup:
            if self._pid != os.getpid():
                # A forked child: the parent releases what it queued.
                self._pending, self._sending, self._pid = [], [], os.getpid()
            self._pending.append(pending)
            if self._thread is None or not self._thread.is_alive():
                self._stopping = False
                self._thread = threading.Thread(target=self._run, name="dramatiq-unique-releaser", daemon=True)
                self._thread.start()
            if self._idle:
                self._wakeup.notify()  # only an idle releaser needs waking; a busy one looks again
            stalled = self._stalled()
        if stalled:
            self.on_stalled(stalled)

    def _stalled(self) -> list[PendingRelease]:
        """The batch in flight, once, when it has waited too long."""
        if not self._sending or self._stall_reported or _now_ms() - self._sending_since < self.stall_after:
            return []
        self._stall_reported = True
        return list(self._sending)

    def pending(self) -> int:
        """How many releases are queued or in flight."""
        with self._wakeup:
            return len(self._pending) + len(self._sending)

    def drain(self, timeout: Optional[float] = None) -> bool:
        """Wait until every submitted release was sent and reported, at
        most ``timeout`` milliseconds (default ``drain_timeout``).

        Returns:
          bool: True when nothing is left.
        """
        deadline = _now_ms() + (self.drain_timeout if timeout is None else timeout)
        with self._wakeup:
            while self._pending or self._sending:
                if self._thread is None or not self._thread.is_alive():
                    return False
                left = deadline - _now_ms()
                if left <= 0:
                    return False
                self._wakeup.wait(timeout=left / 1000)
        return True

    def stop(self, timeout: Optional[float] = None) -> None:
        """Drain, then end the thread.  What is left after ``timeout``
        milliseconds is logged and left to expire with its lease.
        """
        drained = self.drain(timeout)
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify_all()
            left = len(self._pending) + len(self._sending)
        if not drained and left:
            self.logger.warning("%d run lock(s) were not released before shutdown; their leases expire.", left)

    def _run(self) -> None:
        while True:
            with self._wakeup:
                while not self._pending and not self._stopping:
                    self._idle = True
                    self._wakeup.wait(timeout=1.0)
                self._idle = False
                if not self._pending:
                    return
                batch, self._pending = self._pending[: self.batch], self._pending[self.batch :]
                self._sending, self._sending_since, self._stall_reported = batch, _now_ms(), False
            outcomes = self._release(batch)
            for pending, outcome in zip(batch, outcomes):
                self._report(pending, outcome)
            with self._wakeup:
                self._sending = []
                self._wakeup.notify_all()

    def _release(self, batch: list[PendingRelease]) -> list[Outcome]:
        try:
            outcomes = self.backend.release_many([(pending.key, pending.owner) for pending in batch])
        except Exception as e:
            return [e] * len(batch)
        if self._stall_reported:
            self.logger.warning("The lock backend answered %d release(s) after %.0f ms.",
                                len(batch), _now_ms() - self._sending_since)
        return outcomes

    def _report(self, pending: PendingRelease, outcome: Outcome) -> None:
        try:
            pending.done(outcome)
        except Exception:
            self.logger.exception("Could not report the release of %r.", pending.key)
