"""An in-memory, thread-safe lock backend for tests and the demo."""

from __future__ import annotations

import fnmatch
import threading
import time as mod_time
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

from ..backend import Acquisition, EnqueueRecord, LockBackend, LockInfo, Release


def _now_ms() -> int:
    return mod_time.monotonic_ns() // 1_000_000


def _unix_ms() -> int:
    return mod_time.time_ns() // 1_000_000


@dataclass
class _Ticket:
    copies: int = 1
    claimed: bool = False


@dataclass
class _Waiters:
    order: dict[str, tuple[int, bytes]] = field(default_factory=dict)
    tickets: dict[str, _Ticket] = field(default_factory=dict)
    expires_at: int = 0


@dataclass
class _Entry:
    holders: dict[str, int] = field(default_factory=dict)
    lock: str = ""
    lock_args: Optional[str] = None
    fence: int = 0
    #: Enqueue records, with Unix times as RedisBackend keeps them.
    records: dict[str, EnqueueRecord] = field(default_factory=dict)


class StubBackend(LockBackend):
    """An in-memory lock backend.  Locks live in this process only,
    so it suits tests, the demo and single-process workers.

    Deadlines follow ``time.monotonic``.
    """

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._last_fence = 0
        self._waiters: dict[str, _Waiters] = {}

    def _live(self, key: str, now: int) -> Optional[_Entry]:
        entry = self._entries.get(key)
        if entry is None:
            return None
        entry.holders = {owner: deadline for owner, deadline in entry.holders.items() if deadline > now}
        entry.records = {owner: record for owner, record in entry.records.items() if owner in entry.holders}
        if not entry.holders:
            del self._entries[key]
            return None
        return entry

    def acquire(
        self,
        key: str,
        owner: str,
        *,
        ttl: int,
        limit: int = 1,
        lock: str = "",
        lock_args: Optional[str] = None,
        provisional: int = 0,
        where: Optional[str] = None,
    ) -> Acquisition:
        with self._mutex:
            now = _now_ms()
            entry = self._live(key, now) or _Entry()
            short = 0 < provisional < ttl
            if owner in entry.holders:
                old = entry.records.get(owner)
                # As acquire.lua: only a slot still provisional stays so.
                short = short and old is not None and old.provisional_until > 0
                deadline = max(entry.holders[owner], now + (provisional if short else ttl))
                entry.holders[owner] = deadline
                if where is not None:
                    entry.records[owner] = self._record(old, where, deadline - now if short else 0)
                return Acquisition(True, reentered=True, fence=entry.fence, provisional=short)
            if len(entry.holders) >= limit:
                return Acquisition(False, holder=next(iter(entry.holders)), fence=entry.fence)
            self._last_fence = entry.fence = max(self._last_fence + 1, mod_time.time_ns() // 1000)
            entry.holders[owner] = now + (provisional if short else ttl)
            entry.lock = lock
            if lock_args is not None:  # recorded if given, as RedisBackend does
                entry.lock_args = lock_args
            if where is not None:
                entry.records[owner] = EnqueueRecord(_unix_ms(), _unix_ms() + provisional if short else 0, where)
            self._entries[key] = entry
            return Acquisition(True, fence=entry.fence, provisional=short)

    @staticmethod
    def _record(old: Optional[EnqueueRecord], where: str, provisional_for: int) -> EnqueueRecord:
        now = _unix_ms()
        if old is None:
            return EnqueueRecord(now, now + provisional_for if provisional_for else 0, where)
        before = old.before if old.where == where else old.where
        return EnqueueRecord(old.taken_at, now + provisional_for if provisional_for else 0, where, before)

    def release(self, key: str, owner: str, *, hand_over: bool = True) -> Release:
        with self._mutex:
            now = _now_ms()
            entry = self._entries.get(key)
            deadline = entry.holders.pop(owner, None) if entry is not None else None
            if entry is None or deadline is None:
                return Release(False)
            entry.records.pop(owner, None)
            self._live(key, now)  # drops the entry with its last live holder
            return Release(deadline > now, self._promote(key) if hand_over else None)

    def _live_waiters(self, key: str) -> Optional[_Waiters]:
        # Like the Redis keys, the records of a key expire ttl after its last wait.
        waiters = self._waiters.get(key)
        if waiters is not None and waiters.expires_at <= _now_ms():
            del self._waiters[key]
            return None
        return waiters

    def _promote(self, key: str) -> Optional[bytes]:
        waiters = self._live_waiters(key)
        if waiters is None or not waiters.order:
            return None
        ticket = min(waiters.order, key=lambda name: waiters.order[name][0])
        _, message = waiters.order.pop(ticket)
        waiters.tickets[ticket].copies = 2
        return message

    def wait(self, key: str, ticket: str, message: bytes, *, order: int, ttl: int) -> None:
        with self._mutex:
            waiters = self._live_waiters(key) or self._waiters.setdefault(key, _Waiters())
            waiters.order[ticket] = (order, message)
            waiters.tickets[ticket] = _Ticket()
            waiters.expires_at = _now_ms() + ttl

    def claim(self, key: str, ticket: str) -> bool:
        with self._mutex:
            waiters = self._live_waiters(key)
            record = waiters.tickets.get(ticket) if waiters is not None else None
            if waiters is None or record is None:
                return True
            waiters.order.pop(ticket, None)
            record.copies -= 1
            first, record.claimed = not record.claimed, True
            if record.copies <= 0:
                del waiters.tickets[ticket]
            if not waiters.tickets:
                del self._waiters[key]
            return first

    def extend(self, locks: Sequence[tuple[str, str]], ttl: int) -> list[bool]:
        with self._mutex:
            now = _now_ms()
            held = []
            for key, owner in locks:
                entry = self._live(key, now)
                if entry is not None and owner in entry.holders:
                    entry.holders[owner] = now + ttl
                held.append(entry is not None and owner in entry.holders)
            return held

    def confirm(self, locks: Sequence[tuple[str, str, int]]) -> list[bool]:
        with self._mutex:
            now = _now_ms()
            held = []
            for key, owner, ttl in locks:
                entry = self._live(key, now)
                if entry is None or owner not in entry.holders:
                    held.append(False)
                    continue
                entry.holders[owner] = max(entry.holders[owner], now + ttl)
                record = entry.records.get(owner)
                if record is not None:
                    entry.records[owner] = EnqueueRecord(record.taken_at, 0, record.where, record.before)
                held.append(True)
            return held

    def reap(self, key: str, owner: str, record: EnqueueRecord) -> bool:
        with self._mutex:
            now = _now_ms()
            entry = self._live(key, now)
            if entry is None or entry.records.get(owner) != record:
                return False
            del entry.holders[owner]
            del entry.records[owner]
            self._live(key, now)
            return True

    def inspect(self, key: str) -> Optional[LockInfo]:
        with self._mutex:
            now = _now_ms()
            entry = self._live(key, now)
            if entry is None:
                return None
            offset = mod_time.time_ns() // 1_000_000 - now
            holders = {owner: deadline + offset for owner, deadline in entry.holders.items()}
            return LockInfo(key, entry.lock or None, holders, entry.lock_args, entry.fence, dict(entry.records))

    def scan(self, pattern: str) -> Iterator[str]:
        with self._mutex:
            now = _now_ms()
            keys = [key for key in list(self._entries) if self._live(key, now) and fnmatch.fnmatchcase(key, pattern)]
        return iter(sorted(keys))

    def delete(self, key: str) -> bool:
        with self._mutex:
            return self._entries.pop(key, None) is not None
