"""Lifecycle events: what happened to which lock, for listeners, counters and metrics; and the log
lines that tell the same story.  See docs/operations.md, "Lifecycle hooks".

Listeners (``UniqueMiddleware(listeners=[...])`` or ``middleware.events.subscribe``) run on the
thread where the event happened (sender, worker, lease renewal, releaser), so they must be quick
and thread-safe.  One that raises is logged and ignored.
"""

from __future__ import annotations

import itertools
import threading
from importlib import resources
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


def _log_lines() -> tuple[LogLine, ...]:
    """Every line the middleware logs while enqueueing and running, from ``log_lines.tsv`` (data: a
    test holds it to the table in docs/operations.md, "Log lines").  Levels and templates are stable:
    a duplicate is INFO, a dropped message or lapsed lock WARNING, a lost run lock or failing backend ERROR.
    """
    rows = resources.files(__package__).joinpath("log_lines.tsv").read_text(encoding="utf-8").splitlines()
    return tuple(LogLine(*row.split("\t")) for row in rows[1:] if row)


def __getattr__(name: str) -> tuple[LogLine, ...]:
    # Read on first use: it is for tests and tools, and every process that sends imports this module.
    if name == "LOG_LINES":
        globals()[name] = lines = _log_lines()
        return lines
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class LockEvent:
    """One thing that happened to a lock.

    Attributes:
      name(str): One of :data:`EVENTS`.
      holder(str): For conflicts, the holder's message id; for a ``skipped`` duplicate of a run that
        succeeded, that run's lock owner (``<message id>/<token>``).
      reason(str): For ``skipped``, why: ``"done"`` (that run succeeded), ``"stale"`` or ``"lost"``
        (see :class:`~dramatiq_unique.backends.records.CopyVerdict`).
    """

    name: str
    actor: str
    key: str
    message_id: Optional[str] = None
    holder: Optional[str] = None
    reason: Optional[str] = None


Listener = Callable[[LockEvent], None]


class EventHub:
    """Counts events and passes them to listeners; a failing listener is logged, never breaks locking."""

    def __init__(self) -> None:
        self.logger = get_logger(__name__, type(self))
        self._mutex = threading.Lock()
        self._listeners: list[Listener] = []
        # Per (event, actor): ``next()`` is one C call, atomic under the GIL, so counting takes no lock.
        self._counters: dict[tuple[str, str], itertools.count[int]] = {}

    def subscribe(self, listener: Listener) -> Listener:
        """Call ``listener`` with every :class:`LockEvent`.  Usable as a decorator."""
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
        """Count one event; return the listeners, so a caller builds the event only if someone listens."""
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
    """How many ``next()`` calls a ``count()`` had, from its repr: the one reading neither deprecated nor moving it."""
    return int(repr(counter)[len("count(") : -1])
