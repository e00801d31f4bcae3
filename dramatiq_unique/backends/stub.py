"""An in-memory, thread-safe lock backend for tests and the demo."""

from __future__ import annotations

from .rules import LockRules


class StubBackend(LockRules):
    """An in-memory lock backend with the reschedule protocol and newest
    wins: :class:`~.rules.LockRules` on this process's clocks.  Its locks
    live in this process only, for tests, the demo and single-process workers.
    """
