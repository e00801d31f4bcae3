"""Releases that failed, sent again off the worker thread until they land.

A release that fails (a dropped connection, a timeout, Redis down for
a while) would leave its key held until the lock expires: 60 s for a
run lease, 24 h for an ``until_executed`` enqueue lock.  Instead it is
queued here, and one background thread per process (a
:class:`~..background.BackgroundThread`, a greenlet under gevent) sends
it again, with backoff, until it is applied, or until the lock would have expired
anyway, when there is nothing left to free.

A run lock's release is sent on past its lease, for ``record_ttl``:
besides freeing the lock it ends the run of a rescheduled message in
its record, so that a duplicate of that run that comes later is
skipped; the lock itself lapsed and was free meanwhile, and the release
checks its owner (a token of that one execution), so it frees nothing
else.

A failed release may have been applied (its reply was lost), so a
retry that finds the owner gone reports nothing: the lock was freed,
by the first send or by its expiry, and never by another owner's
release (the release script checks the owner).  The worker's shutdown
sends what is left once more, waits at most ``drain_timeout`` (or what
is left of the shutdown's bound), and hands what is still left to the
middleware, which writes it to the broker for the next worker
(:mod:`.owed`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Union

from dramatiq.logging import get_logger

from ..backends.base import LockBackend, Release
from ..background import DEFAULT_STOP_TIMEOUT, JITTER, BackgroundThread, now_ms, pid
from .delivery import HandOff, LockToRelease

#: Milliseconds before the first retry of a failed release; each retry
#: waits twice as long as the one before, up to ``DEFAULT_MOST_BETWEEN``.
DEFAULT_FIRST_RETRY = 100

#: The longest wait between two retries, in milliseconds: a key is
#: accepted again within about this long of the network coming back.
DEFAULT_MOST_BETWEEN = 1_000

#: How long, in milliseconds, the worker's shutdown waits for them.
DEFAULT_DRAIN_TIMEOUT = 5_000

#: The most releases sent in one round trip.
BATCH = 256

#: How a run lock's key ends (``LockContext.key(..., "run")``).
RUN_SUFFIX = ":run"


@dataclass(eq=False)
class FailedRelease:
    """One release to send again.

    Attributes:
      key(str): The lock key.
      owner(str): The owner the release checks.
      until(float): Monotonic milliseconds when the lock expires by
        itself: no retry after that.
      lock(LockToRelease): What reporting its outcome needs.
      succeeded(bool): The run succeeded: the release finishes its
        message (see ``LockBackend.release``).
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
        """The release call's keyword arguments, as a stopping worker
        hands the release on to the next (:mod:`.owed`).
        """
        return {"succeeded": self.succeeded}


class LandedReports(Protocol):
    """Where :class:`FailedReleases` reports, on its thread: ``landed``
    once a retry is applied, which may return a hand-off, which
    ``hand_over`` does there too.
    """

    def landed(self, failed: FailedRelease, outcome: Release) -> Optional[HandOff]: ...

    def hand_over(self, handoff: HandOff) -> None: ...


class FailedReleases:
    """Sends failed releases of one process again, in the background.

    Parameters:
      backend(LockBackend): Where the locks live.
      reports(LandedReports): Where the releases that landed are reported.
      first_retry(int): Milliseconds before the first retry.
      most_between(int): The longest wait between retries, in ms.
      drain_timeout(int): How long ``stop`` waits, in ms.
      record_ttl(int): How long past its lease a run lock's release is
        still sent, in ms (0: not at all); the middleware passes
        ``lock_ttl``, the life of a message record.
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
        self.logger = get_logger(__name__, type(self))
        self.backend = backend
        self.reports = reports
        self.record_ttl = record_ttl
        self.first_retry = first_retry
        self.most_between = most_between
        self.drain_timeout = drain_timeout
        self._reset()
        # A greenlet under gevent: it sends with the backend's own client.
        self._thread = BackgroundThread(
            name="dramatiq-unique-release-retries", loop=self._run, on_fork=self._reset, on_wake=self._notify
        )

    def _reset(self) -> None:
        # Also run in a forked child: what the parent failed to release is
        # the parent's, and its lock may have been held at the fork.
        self._failed: list[FailedRelease] = []
        self._sending = 0
        self._stuck: list[FailedRelease] = []  # the batch in flight, until its outcome is known
        self._wakeup = threading.Condition(threading.Lock())

    def _notify(self) -> None:
        with self._wakeup:
            self._wakeup.notify_all()

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
        """Send, in one round trip, the releases due now (``force``: all
        of them), and report or queue again each outcome.
        """
        with self._wakeup:
            batch = self._take_due(force=force)
        if batch:
            self._send(batch)

    def drain(self, timeout: Optional[float] = None) -> bool:
        """Retry until nothing is left, at most ``timeout`` ms (default
        ``drain_timeout``), on the calling thread.

        Returns:
          bool: True when nothing is left.
        """
        deadline = now_ms() + (self.drain_timeout if timeout is None else timeout)
        while self.pending():
            if now_ms() >= deadline:
                return False
            self.step(force=True)
            with self._wakeup:
                if self._failed or self._sending:
                    self._wakeup.wait(timeout=min(self.first_retry, max(deadline - now_ms(), 0)) / 1000)
        return True

    def stop(self, timeout: Optional[float] = None) -> list[FailedRelease]:
        """Drain, then end the thread.

        Returns:
          list[FailedRelease]: What is left: the releases not sent, and
          those whose send is stuck (it may have been applied), for the
          caller to hand on (:mod:`.owed`); past their ``until`` none.
        """
        drained = self.drain(timeout)
        with self._wakeup:
            left, self._failed = self._failed, []
            stuck, self._stuck = self._stuck, []
        # A thread stuck in a call is not waited for again: the drain did.
        self._thread.stop(timeout=min(DEFAULT_STOP_TIMEOUT, timeout or DEFAULT_STOP_TIMEOUT) if drained else 0)
        now = now_ms()
        return [failed for failed in left + stuck if failed.until > now]

    # The thread ---------------------------------------------------------

    def _ensure_thread(self) -> None:
        """Start the retry thread unless it runs; the lock is held."""
        self._thread.ensure_started()

    def _run(self, thread: BackgroundThread) -> None:
        try:
            while True:
                with self._wakeup:
                    batch = self._next(thread)
                    if batch is None:
                        thread.retire()  # under the lock: a submission from now on starts a new thread
                        return
                self._send(batch)
        except BaseException:
            with self._wakeup:
                thread.retire()  # the next submission starts a new thread (the base logs the error)
            raise

    def _next(self, thread: BackgroundThread) -> Optional[list[FailedRelease]]:
        """Wait, holding the lock, for releases due; None to end."""
        while True:
            if thread.stopping or not self._failed:
                return None
            batch = self._take_due(force=False)
            if batch:
                return batch
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
