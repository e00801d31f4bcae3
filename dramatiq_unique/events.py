"""Lifecycle events: what happened to which lock, for listeners,
counters and metrics.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional

from dramatiq.logging import get_logger

#: Every event name, in the order a lock meets them.
EVENTS = (
    "locked",  # a lock or lease was taken
    "duplicate",  # a send was refused: its key was held (client conflict)
    "conflict",  # a delivery met a held run lock and was dropped, failed or dead-lettered
    "rescheduled",  # a delivery met a held run lock and was re-enqueued for later
    "released",  # a lock was released by its owner
    "lock_lost",  # a lock expired or was taken before its owner released it
    "backend_error",  # the lock backend failed
)


@dataclass(frozen=True)
class LockEvent:
    """One thing that happened to a lock.

    Attributes:
      name(str): One of :data:`EVENTS`.
      actor(str): The actor's name.
      key(str): The lock key.
      message_id(str): The message concerned.
      holder(str): For conflicts, the message id of the holder.
    """

    name: str
    actor: str
    key: str
    message_id: Optional[str] = None
    holder: Optional[str] = None


Listener = Callable[[LockEvent], None]


class EventHub:
    """Counts events and passes them to listeners.  A failing listener
    is logged and never breaks locking.
    """

    def __init__(self) -> None:
        self.logger = get_logger(__name__, type(self))
        self._mutex = threading.Lock()
        self._listeners: list[Listener] = []
        self.counts: Counter[tuple[str, str]] = Counter()

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
        with self._mutex:
            return sum(n for (event, who), n in self.counts.items() if event == name and actor in (None, who))

    def emit(self, event: LockEvent) -> None:
        with self._mutex:
            self.counts[event.name, event.actor] += 1
            listeners = self._listeners
        for listener in listeners:
            try:
                listener(event)
            except Exception:
                self.logger.exception("Lock event listener %r failed on %r.", listener, event)
