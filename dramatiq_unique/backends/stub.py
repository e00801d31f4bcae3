"""An in-memory, thread-safe lock backend for tests and the demo."""

from __future__ import annotations

from .rules import LockRules


class StubBackend(LockRules):
    """An in-memory lock backend.  Locks live in this process only,
    so it suits tests, the demo and single-process workers.  It has the
    reschedule protocol and newest wins (see
    :mod:`~dramatiq_unique.backends.capabilities`): the rules of
    :class:`~.rules.LockRules`, on this process's clocks.

    Deadlines follow ``time.monotonic``.
    """
