"""Confirms provisional enqueue locks, off the callers' threads.

A new enqueue lock holds for the provisional window only (30 s by default), so that a producer dying
before its publish leaves a key that frees itself.  Once the publish returned, the :class:`Confirmer`
gives it its full lifetime (lock_ttl + delay, ~0.1 s later), in one round trip with every other lock
due then.  It never revives a slot that was released (a worker ran the message first) or lapsed and
was taken by someone else.
"""

from __future__ import annotations

import atexit
import threading
import time as mod_time
import weakref
from collections import deque
from typing import Callable, Iterable, NamedTuple, Optional

from dramatiq.logging import get_logger

from ..backends.base import LockBackend
from ..background import BackgroundThread, now_ms, pid

#: The most locks one round trip confirms.
DEFAULT_BATCH = 500
#: How long, in ms, the confirmer gathers locks before a round trip: a busy producer then shares one
#: round trip, and one wake-up of the thread, among many sends, for this much more crash window.
DEFAULT_LINGER = 100
#: The wait, in ms, before a failed confirmation is tried again.
RETRY_INTERVAL = 500
#: How long, in ms, a round trip may take before a new thread takes over its locks.
CALL_TIMEOUT = 5_000
#: How many locks may wait; more lapse after the provisional window, logged.
MAX_WAITING = 100_000
#: How long an exiting process waits for its confirmations, in seconds.
EXIT_TIMEOUT = 5.0
#: How long, in ms, :meth:`Confirmer.stop` waits for the thread once it confirmed what it could.
STOP_TIMEOUT = 1_000


class Pending(NamedTuple):
    """A provisional lock awaiting confirmation: ``owner`` is the message id, ``ttl`` the full lifetime
    to give it (ms), ``lapses_at`` the monotonic ms after which the slot is gone and confirming it pointless.
    """

    key: str
    owner: str
    ttl: int
    actor: str
    lapses_at: float


class Confirmer:
    """One background thread per process that confirms provisional locks (a greenlet under gevent).

    ``on_lapsed`` is called with each :class:`Pending` not confirmed before its window ran out.
    """

    def __init__(self, backend: LockBackend, *, on_lapsed: Optional[Callable[[Pending], None]] = None) -> None:
        self.logger = get_logger(__name__, type(self))
        self.backend = backend
        self.on_lapsed = on_lapsed
        self._reset()
        # Each start is a generation: a thread stuck in a call is retired, and exits silently on seeing a newer one.
        self._thread = BackgroundThread(
            name="dramatiq-unique-confirm", loop=self._loop, on_fork=self._reset, on_wake=self._notify
        )
        _LIVE.add(self)

    def _reset(self) -> None:
        # Also run in a forked child: the parent's locks are its own, and the condition may have been held.
        self._pid = pid()
        self._wakeup = threading.Condition(threading.Lock())
        self._waiting: deque[Pending] = deque()
        #: The batch being confirmed, and since when (monotonic ms).
        self._inflight: list[Pending] = []
        self._busy_since: Optional[float] = None
        self._hurry = False

    def _notify(self) -> None:
        with self._wakeup:
            self._wakeup.notify_all()

    def submit(self, locks: Iterable[Pending]) -> None:
        """Queue ``locks`` for confirmation; never blocks on the backend."""
        # The sending thread runs this once per send: keep it lean.
        with self._wakeup:
            waiting = self._waiting
            was_empty = not waiting
            waiting.extend(locks)
            if len(waiting) > MAX_WAITING:
                self.logger.warning(
                    "Dropped %d lock(s) waiting for confirmation: they lapse after the provisional window.",
                    len(waiting) - MAX_WAITING,
                )
                while len(waiting) > MAX_WAITING:
                    waiting.pop()
            if self._thread.running_in != pid() or self._busy_since is not None:
                self._check_thread()
            if was_empty:
                self._wakeup.notify()

    def _check_thread(self) -> None:
        """Start the thread, or replace it after :data:`CALL_TIMEOUT` in one call (a silent network can
        hold a call for minutes).  Called with the condition held.
        """
        if self._busy_since is not None and now_ms() - self._busy_since > CALL_TIMEOUT:
            self.logger.warning(
                "Could not confirm %d enqueue lock(s): %r. Trying again.",
                len(self._inflight),
                TimeoutError(f"the lock backend did not answer within {CALL_TIMEOUT} ms"),
            )
            self._waiting.extendleft(reversed(self._inflight))
            self._inflight, self._busy_since = [], None
            self._thread.retire()  # what the stuck call still does is ignored
        self._thread.ensure_started()

    def waiting(self) -> int:
        """How many locks wait for confirmation, or are being confirmed."""
        with self._wakeup:
            return len(self._waiting) + len(self._inflight)

    def flush(self, timeout: float = EXIT_TIMEOUT) -> bool:
        """Wait at most ``timeout`` seconds until every submitted lock was confirmed (or gave up); True if none left."""
        deadline = mod_time.monotonic() + timeout
        with self._wakeup:
            self._hurry = True
            try:
                while self._waiting or self._inflight:
                    left = deadline - mod_time.monotonic()
                    if left <= 0:
                        return False
                    self._check_thread()
                    self._wakeup.notify_all()
                    self._wakeup.wait(timeout=min(left, 0.05))
                return True
            finally:
                self._hurry = False

    def stop(self, timeout: float = EXIT_TIMEOUT) -> None:
        """Confirm what is waiting, at most ``timeout`` seconds, then stop the thread."""
        self.flush(timeout)
        self._thread.stop(timeout=STOP_TIMEOUT)

    def _loop(self, thread: BackgroundThread) -> None:
        # Read once, at start: a newer generation comes only after this one was retired, stuck in a call.
        generation = thread.generation
        while True:
            with self._wakeup:
                while not self._waiting and not thread.stopping and thread.generation == generation:
                    self._wakeup.wait()
                if not self._hurry and thread.generation == generation:
                    # Gather the next moments into one round trip: each wake-up costs the sender a GIL hand-over.
                    self._wakeup.wait(DEFAULT_LINGER / 1000)
                if thread.generation != generation:
                    return  # retired and replaced: the newer thread has its locks
                if not self._waiting:
                    thread.retire()  # stopped, under the lock: a submission from now on starts a new thread
                    return
                batch = [self._waiting.popleft() for _ in range(min(DEFAULT_BATCH, len(self._waiting)))]
                self._inflight, self._busy_since = batch, now_ms()
            try:
                self._confirm(batch, thread, generation)
            finally:
                with self._wakeup:
                    if thread.generation == generation:
                        self._inflight, self._busy_since = [], None
                    self._wakeup.notify_all()

    def _confirm(self, batch: list[Pending], thread: BackgroundThread, generation: int) -> None:
        now = now_ms()
        due = [lock for lock in batch if lock.lapses_at > now]
        for lock in batch:
            if lock.lapses_at <= now:
                self._lapsed(lock)
        if not due:
            return
        try:
            # A gone slot was released by a worker that ran the message first, or lapsed: nothing to do.
            self.backend.confirm([(lock.key, lock.owner, lock.ttl) for lock in due])
        except Exception as e:
            self.logger.warning("Could not confirm %d enqueue lock(s): %r. Trying again.", len(due), e)
            mod_time.sleep(min(RETRY_INTERVAL, max(0.0, min(lock.lapses_at for lock in due) - now_ms())) / 1000)
            with self._wakeup:
                if thread.generation == generation:
                    self._waiting.extendleft(reversed(due))

    def _lapsed(self, lock: Pending) -> None:
        self.logger.error(
            "Enqueue lock %r of message %s lapsed before it could be confirmed; its key is free again.",
            lock.key,
            lock.owner,
        )
        if self.on_lapsed is not None:
            self.on_lapsed(lock)


_LIVE: "weakref.WeakSet[Confirmer]" = weakref.WeakSet()


def _at_exit() -> None:
    # A script that sends and exits must not leave its locks provisional.
    deadline = mod_time.monotonic() + EXIT_TIMEOUT
    for confirmer in list(_LIVE):
        if confirmer._pid == pid():
            confirmer.flush(max(0.0, deadline - mod_time.monotonic()))


atexit.register(_at_exit)
