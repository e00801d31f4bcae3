"""What a send stamps on a message, and how a lock names its message.

A new message gets its place among its producer's sends of the same
millisecond (waiters of one key are handed the key in that order); each
delivery is one copy of its message (:class:`~..backends.records.Copy`),
named by the options the sends stamped (their names, and how a lock
owner names its message, are in :mod:`..model.wire`).  The send side
stamps these, the worker and the operators read them.
"""

from __future__ import annotations

import threading
from typing import Any

from ..backends.records import SENDS_PER_MS, Copy
from ..model.wire import UNIQUE_LOCK_ARGS, UNIQUE_RESCHEDULES, UNIQUE_SEQ, UNIQUE_VIA


class _SendOrder:
    """The place of each send among this process's sends of the same
    millisecond: waiters of one key are handed the key in send order,
    and message ids, the only other tie-breaker, are random.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ms, self._next = -1, 0

    def stamp(self, message: Any) -> None:
        """Stamp ``unique_seq`` on a new message (never on a re-enqueue:
        a retry or a move keeps its place).
        """
        ms = int(message.message_timestamp)
        with self._lock:
            if ms != self._ms:
                self._ms, self._next = ms, 0
            seq, self._next = self._next, self._next + 1
        message.options[UNIQUE_SEQ] = min(seq, SENDS_PER_MS - 1)


#: Stamps the send order of this process's new messages.
send_sequence = _SendOrder()


def send_order(message: Any) -> int:
    """Where a waiting message stands among its key's waiters: the
    millisecond its message was made, then its place among its
    producer's messages of that millisecond.
    """
    return int(message.message_timestamp) * SENDS_PER_MS + int(message.options.get(UNIQUE_SEQ, 0))


def copy_of(message: Any, key: str) -> Copy:
    """Which copy of its message ``message`` is, for the run lock ``key``."""
    options = message.options
    # Built in C (every job makes one): a named tuple's own constructor runs Python.
    fields = (
        key,
        message.message_id,
        options.get(UNIQUE_RESCHEDULES, 0),
        options.get(UNIQUE_VIA, ""),
        options.get(UNIQUE_LOCK_ARGS),  # stamped at send under record_lock_args only
        options.get("retries", 0),
    )
    return tuple.__new__(Copy, fields)
