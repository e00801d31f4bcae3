"""What :class:`~.rules.LockRules` keeps of each key, as the Redis scripts
keep it in the key's hash and companion keys; ``PostgresBackend`` stores
it as one row per key (:mod:`.postgres.state`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional

from .records import EnqueueRecord


@dataclass
class MessageRecord:
    """A message's reschedule, its winning copy, the copies to come, and its run (``_claim.lua``)."""

    attempt: int
    winner: str
    expires_at: int
    out: set[tuple[int, str]] = field(default_factory=set)
    #: The run lock owner it runs under, and as which copy ``(attempt, via, retries)``.
    runner: Optional[str] = None
    ran: tuple[int, str, int] = (0, "", 0)
    #: The succeeded run's Retries count (or None), copy, and owner.
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
    """One lock key: holders, what took it, its fence, and under newest wins its messages."""

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
    #: Each holder's record, with Unix times as RedisBackend keeps them.
    records: dict[str, EnqueueRecord] = field(default_factory=dict)
    #: Slots handed to a waiter: message id -> deadline (see _take.lua).
    reserved: dict[str, int] = field(default_factory=dict)

    def taken(self, lock: str, lock_args: Optional[str]) -> None:
        """Record the lock type, and the lock args when given (as RedisBackend does)."""
        self.lock = lock
        if lock_args is not None:
            self.lock_args = lock_args


@dataclass
class SupersededBy:
    """An enqueue lock key's superseded record: message id -> the one that superseded it."""

    by: dict[str, str] = field(default_factory=dict)
    expires_at: int = 0


class KeyState(NamedTuple):
    """All a :class:`LockRules` keeps of one key, for a backend that stores it elsewhere; records by message id."""

    entry: Optional[Entry]
    waiters: Optional[Waiters]
    superseded: Optional[SupersededBy]
    records: dict[str, MessageRecord]
    last_fence: int
