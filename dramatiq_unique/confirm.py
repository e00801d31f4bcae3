"""Confirms provisional enqueue locks, off the callers' threads.

A new enqueue lock is taken for the provisional window only (30 s by
default), so that a producer that dies before its message is published
leaves a key that frees itself within that window.  Once the publish has
returned, the guarded enqueue hands the lock to this process's
:class:`Confirmer`, which gives it its full lifetime in one round trip
with every other lock due at the time.

Timeline of one send, with the default window::

  t=0       send(): acquire, provisional until t=30 s (caller's thread)
  t=0+      publish returns; the lock is queued for confirmation
  t=0.1 s   the confirmer confirms it, with the others queued meanwhile:
            it now lasts lock_ttl (+ the message's delay)
  (crash between acquire and publish: the key is free at t=30 s)

A confirmation never revives a slot that was released (a worker that
ran the message first) or that lapsed and was taken by someone else.
"""

from __future__ import annotations

import atexit
import os
import threading
import time as mod_time
import weakref
from collections import deque
from typing import Callable, Iterable, NamedTuple, Optional

from dramatiq.logging import get_logger

from .backend import LockBackend

#: How many locks one round trip confirms at most.
DEFAULT_BATCH = 500

#: How long the confirmer gathers locks before a round trip, in
#: milliseconds: a busy producer then shares one round trip (and one
#: wake-up of the thread) among many sends, at the price of this much
#: more time in the crash window.
DEFAULT_LINGER = 100

#: How long a failed confirmation waits before it is tried again, in
#: milliseconds.
RETRY_INTERVAL = 500

#: How long a round trip may take before the thread making it is
#: abandoned and a new one takes over its locks, in milliseconds.
CALL_TIMEOUT = 5_000

#: How many locks may wait for confirmation; more are not confirmed and
#: lapse after the provisional window (logged).
MAX_WAITING = 100_000

#: How long a process that exits waits for its confirmations, in seconds.
EXIT_TIMEOUT = 5.0


def _now_ms() -> float:
    return mod_time.monotonic() * 1000


class Pending(NamedTuple):
    """A provisional lock awaiting confirmation.

    Attributes:
      key(str): The lock key.
      owner(str): Its holder: the message id.
      ttl(int): The full lifetime to give it, in milliseconds.
      actor(str): The actor, for events and logs.
      lapses_at(float): Monotonic milliseconds after which the
        provisional slot is gone, and confirming it is pointless.
    """

    key: str
    owner: str
    ttl: int
    actor: str
    lapses_at: float


class Confirmer:
    """One daemon thread per process that confirms provisional locks.

    Parameters:
      backend(LockBackend): Where the locks live.
      on_lapsed(callable): Called with each :class:`Pending` that could
        not be confirmed before its window ran out.
    """

    def __init__(self, backend: LockBackend, *, on_lapsed: Optional[Callable[[Pending], None]] = None) -> None:
        self.logger = get_logger(__name__, type(self))
        self.backend = backend
        self.on_lapsed = on_lapsed
        self._reset()
        _LIVE.add(self)

    def _reset(self) -> None:
        # Also run in a forked child: the parent's thread is not there,
        # and its condition may have been held at the fork.
        self._pid = os.getpid()
        self._wakeup = threading.Condition(threading.Lock())
        self._waiting: deque[Pending] = deque()
        #: The batch being confirmed, and since when (monotonic ms).
        self._inflight: list[Pending] = []
        self._busy_since: Optional[float] = None
        #: Bumped to abandon a thread stuck in a call; it then exits.
        self._generation = 0
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self._hurry = False

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
            if self._thread is None or self._busy_since is not None:
                self._check_thread()
            if was_empty:
                self._wakeup.notify()

    def _check_thread(self) -> None:
        """Start the thread if it is not running, or replace it when it
        has waited for the backend longer than :data:`CALL_TIMEOUT` (a
        silent network can hold a call for minutes).  Called with the
        condition held.
        """
        if self._busy_since is not None and _now_ms() - self._busy_since > CALL_TIMEOUT:
            self.logger.warning(
                "Could not confirm %d enqueue lock(s): %r. Trying again.",
                len(self._inflight),
                TimeoutError(f"the lock backend did not answer within {CALL_TIMEOUT} ms"),
            )
            self._waiting.extendleft(reversed(self._inflight))
            self._inflight, self._busy_since, self._thread = [], None, None
            self._generation += 1
        if self._thread is None or not self._thread.is_alive():
            self._stopping = False
            self._thread = threading.Thread(
                target=self._run, args=(self._generation,), name="dramatiq-unique-confirm", daemon=True
            )
            self._thread.start()

    def waiting(self) -> int:
        """How many locks wait for confirmation, or are being confirmed."""
        with self._wakeup:
            return len(self._waiting) + len(self._inflight)

    def flush(self, timeout: float = EXIT_TIMEOUT) -> bool:
        """Wait until every submitted lock was confirmed (or gave up),
        at most ``timeout`` seconds.

        Returns:
          bool: True when nothing is left waiting.
        """
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
        """Confirm what is waiting, at most ``timeout`` seconds, then
        stop the thread.
        """
        self.flush(timeout)
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=1)

    def _run(self, generation: int) -> None:
        try:
            self._loop(generation)
        finally:
            with self._wakeup:
                if self._generation == generation:
                    self._thread = None

    def _loop(self, generation: int) -> None:
        while True:
            with self._wakeup:
                while not self._waiting and not self._stopping and self._generation == generation:
                    self._wakeup.wait()
                if not self._hurry and self._generation == generation:
                    # Gather what the next moments bring into one round
                    # trip: every wake-up of this thread costs the sending
                    # thread a hand-over of the GIL.
                    self._wakeup.wait(DEFAULT_LINGER / 1000)
                if self._generation != generation or not self._waiting:
                    return
                batch = [self._waiting.popleft() for _ in range(min(DEFAULT_BATCH, len(self._waiting)))]
                self._inflight, self._busy_since = batch, _now_ms()
            try:
                self._confirm(batch, generation)
            finally:
                with self._wakeup:
                    if self._generation == generation:
                        self._inflight, self._busy_since = [], None
                    self._wakeup.notify_all()

    def _confirm(self, batch: list[Pending], generation: int) -> None:
        now = _now_ms()
        due = [lock for lock in batch if lock.lapses_at > now]
        for lock in batch:
            if lock.lapses_at <= now:
                self._lapsed(lock)
        if not due:
            return
        try:
            # A slot that is gone was released by a worker that ran the
            # message first, or lapsed: either way there is nothing to do.
            self.backend.confirm([(lock.key, lock.owner, lock.ttl) for lock in due])
        except Exception as e:
            self.logger.warning("Could not confirm %d enqueue lock(s): %r. Trying again.", len(due), e)
            mod_time.sleep(min(RETRY_INTERVAL, max(0.0, min(lock.lapses_at for lock in due) - _now_ms())) / 1000)
            with self._wakeup:
                if self._generation == generation:
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


def _after_fork() -> None:
    for confirmer in list(_LIVE):
        confirmer._reset()


def _at_exit() -> None:
    # A script that sends and exits must not leave its locks provisional.
    deadline = mod_time.monotonic() + EXIT_TIMEOUT
    for confirmer in list(_LIVE):
        if confirmer._pid == os.getpid():
            confirmer.flush(max(0.0, deadline - mod_time.monotonic()))


os.register_at_fork(after_in_child=_after_fork)
atexit.register(_at_exit)
