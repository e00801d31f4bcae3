"""What :class:`~.rules.LockRules` keeps of each key, in memory: the
lock entry, its waiters, its superseded record and the records of its
messages, as the Redis scripts keep them in the key's hash and its
companion keys.  ``PostgresBackend`` stores the same, one row per key
(:mod:`.postgres.state`, which encodes these dataclasses by their hints).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional

from .records import EnqueueRecord


@dataclass
class MessageRecord:
    """Which reschedule a message waits in, which copy won it, the
    copies still to come, and whose run ended (see ``_claim.lua``).
    """

    attempt: int
    winner: str
    expires_at: int
    out: set[tuple[int, str]] = field(default_factory=set)
    #: The run lock owner the message runs under, and as which copy
    #: ``(attempt, via, retries)``.
    runner: Optional[str] = None
    ran: tuple[int, str, int] = (0, "", 0)
    #: The Retries count of the copy whose run succeeded, or None, that
    #: copy ``(attempt, via, retries)``, and the owner it ran under.
    finished: Optional[int] = None
    finished_as: Optional[tuple[int, str, int]] = None
    finished_by: Optional[str] = None


@dataclass
class Waiters:
    """Message id -> (order, encoded message to hand the key to)."""

    order: dict[str, tuple[int, bytes]] = field(default_factory=dict)
    expires_at: int = 0


@dataclass
class Entry:
    """One lock key: its holders and their deadlines, what took it, its
    fence, and under newest wins its current and superseded messages.
    """

    holders: dict[str, int] = field(default_factory=dict)
    lock: str = ""
    lock_args: Optional[str] = None
    fence: int = 0
    current: Optional[str] = None
    started: Optional[str] = None
    burst: int = 0
    superseded: int = 0
    previous: Optional[str] = None
    #: The record ``previous`` had when it was superseded.
    previous_record: Optional[EnqueueRecord] = None
    #: Each holder's record (its taken time, and for an enqueue lock where
    #: its message went), with Unix times as RedisBackend keeps them.
    records: dict[str, EnqueueRecord] = field(default_factory=dict)
    #: Slots handed to a waiter: message id -> deadline (see _take.lua).
    reserved: dict[str, int] = field(default_factory=dict)

    def taken(self, lock: str, lock_args: Optional[str]) -> None:
        """Record who took the key: the lock type, and the lock args
        when given (as RedisBackend does, keeping earlier ones otherwise).
        """
        self.lock = lock
        if lock_args is not None:
            self.lock_args = lock_args


@dataclass
class SupersededBy:
    """The superseded record of an enqueue lock key: message id -> the
    message that superseded it.
    """

    by: dict[str, str] = field(default_factory=dict)
    expires_at: int = 0


class KeyState(NamedTuple):
    """Everything a :class:`LockRules` keeps of one key, for a backend
    that stores it elsewhere and runs these rules on it
    (``PostgresBackend``): the lock, its waiters, its superseded
    record, its messages' records by message id, and the last fence.
    """

    entry: Optional[Entry]
    waiters: Optional[Waiters]
    superseded: Optional[SupersededBy]
    records: dict[str, MessageRecord]
    last_fence: int
