"""Quick pick-up of handed-over messages on the Redis broker.

When a run lock is released, its longest waiter is enqueued at once
(the hand-off).  Dramatiq's Redis consumer then finds it on its next
poll, but a consumer whose queue was empty for the length of a job has
backed off to 40–160 ms between polls, and a chain of same-key jobs
pays that on every hand-off.  So, after this process hands a key over
on a queue it consumes, its consumer polls that queue at most every
``poll`` milliseconds (Dramatiq's own first backoff step) until no hand-off
has happened for ``hold`` milliseconds; then its own backoff comes back.

Only the consumer's backoff cap (``timeout``) changes, and only on
Dramatiq's Redis consumer; with any other broker this does nothing.
"""

from __future__ import annotations

import threading
from typing import Any

from dramatiq.common import q_name

from ..background import BackgroundThread, now_ms, pid
from ..compat import redis_consumer_backoff, set_redis_consumer_backoff

#: The longest wait between two polls of a queue that just got a
#: hand-off, in milliseconds.
DEFAULT_POLL = 5

#: How long quick polling lasts after the last hand-off, in milliseconds.
DEFAULT_HOLD = 5_000


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
