"""The lock rules in memory: what every verb does to a key's holders,
waiters and records, as the Lua scripts do it on Redis.  They run in
:class:`~.stub.StubBackend` and, on the rows one call locked, in
``PostgresBackend`` (:mod:`.postgres.state`): so the rules of the claim
are written twice in all, here and in the scripts.
"""

from __future__ import annotations

import threading
import time as mod_time
from typing import Any, Callable, Iterator, Optional, Sequence

from ..model.wire import split_owner
from .base import glob_pattern
from .capabilities import NewestWins, Reschedules
from .keystate import Entry, KeyState, MessageRecord, SupersededBy, Waiters
from .records import (
    DEFAULT_RESERVE,
    DUPLICATE_WINDOW,
    Acquisition,
    Copy,
    CopyVerdict,
    CurrentArgs,
    CurrentCheck,
    CurrentStatus,
    EnqueueRecord,
    LockInfo,
    Release,
    ReplaceArgs,
    Replacement,
    ReplaceStatus,
    Start,
    StartArgs,
    TakeArgs,
    Waiter,
)


class LockRules(Reschedules, NewestWins):
    """The rules of every verb, on state held in memory, thread-safe.

    Parameters:
      clock(int): A fixed clock for every call, in Unix microseconds (a
        PostgreSQL server's, read as the call locked its rows); None:
        ``time.monotonic`` for deadlines, ``time.time`` for records and fences.
    """

    def __init__(self, *, clock: Optional[int] = None) -> None:
        self.clock = clock
        self._mutex = threading.Lock()
        self._entries: dict[str, Entry] = {}
        self._last_fence = 0
        self._waiters: dict[str, Waiters] = {}
        self._superseded: dict[str, SupersededBy] = {}
        self._records: dict[tuple[str, str], MessageRecord] = {}

    def _now_ms(self) -> int:
        """The clock of deadlines, in milliseconds."""
        return mod_time.monotonic_ns() // 1_000_000 if self.clock is None else self.clock // 1000

    def _unix_ms(self) -> int:
        """The clock of records, in Unix milliseconds."""
        return mod_time.time_ns() // 1_000_000 if self.clock is None else self.clock // 1000

    def _unix_us(self) -> int:
        """The clock of fences, in Unix microseconds."""
        return mod_time.time_ns() // 1000 if self.clock is None else self.clock

    def key_state(self, key: str) -> KeyState:
        """What this backend keeps of ``key``, as it is (nothing pruned)."""
        records = {message_id: record for (of, message_id), record in self._records.items() if of == key}
        entry, waiters, superseded = self._entries.get(key), self._waiters.get(key), self._superseded.get(key)
        return KeyState(entry, waiters, superseded, records, self._last_fence)

    def load_key_state(self, key: str, state: KeyState) -> None:
        if state.entry is not None:
            self._entries[key] = state.entry
        if state.waiters is not None:
            self._waiters[key] = state.waiters
        if state.superseded is not None:
            self._superseded[key] = state.superseded
        for message_id, record in state.records.items():
            self._records[(key, message_id)] = record
        self._last_fence = max(self._last_fence, state.last_fence)

    def _live(self, key: str, now: int) -> Optional[Entry]:
        entry = self._entries.get(key)
        if entry is None:
            return None
        entry.holders = {owner: deadline for owner, deadline in entry.holders.items() if deadline > now}
        entry.records = {owner: record for owner, record in entry.records.items() if owner in entry.holders}
        entry.reserved = {message: deadline for message, deadline in entry.reserved.items() if deadline > now}
        if not entry.holders and not entry.reserved:
            del self._entries[key]
            return None
        return entry

    def acquire(self, key: str, owner: str, *, copy: Optional[Copy] = None, **take: Any) -> Acquisition:
        with self._mutex:
            verdict = self._claim(copy, write=False) if copy is not None else None
            if verdict is not None:
                return Acquisition(False, refused=verdict)
            return self._take(key, owner, TakeArgs(**take))

    def _take(
        self, key: str, owner: str, take: TakeArgs, ahead: Optional[Callable[[Entry], bool]] = None
    ) -> Acquisition:
        """take() of _take.lua; when ``ahead`` returns True, nothing is taken."""
        ttl, limit, lock, lock_args, provisional, where = take
        now = self._now_ms()
        entry = self._live(key, now) or Entry()
        short = 0 < provisional < ttl
        if owner in entry.holders:
            old = entry.records.get(owner)
            # As _take.lua: only a slot still provisional stays so.
            short = short and old is not None and old.provisional_until > 0
            deadline = max(entry.holders[owner], now + (provisional if short else ttl))
            entry.holders[owner] = deadline
            if where is not None:
                entry.records[owner] = self._record(old, where, deadline - now if short else 0)
            # As _take.lua: a taken slot names its owner as the holder.
            return Acquisition(True, reentered=True, holder=owner, fence=entry.fence, provisional=short)
        message = split_owner(owner).message_id
        others = [name for name in entry.reserved if name != message]
        if len(entry.holders) + len(others) >= limit:
            return Acquisition(False, holder=next(iter([*entry.holders, *others])), fence=entry.fence)
        if entry.reserved.pop(message, None) is None and ahead is not None and ahead(entry):
            self._entries[key] = entry
            return Acquisition(False, fence=entry.fence)
        self._fence(entry)
        entry.holders[owner] = now + (provisional if short else ttl)
        entry.taken(lock, lock_args)
        # As _take.lua: a slot taken without a place (a run lock) still records when.
        taken_at = self._unix_ms()
        entry.records[owner] = EnqueueRecord(taken_at, taken_at + provisional if short else 0, where or "")
        self._entries[key] = entry
        return Acquisition(True, holder=owner, fence=entry.fence, provisional=short)

    def _record(self, old: Optional[EnqueueRecord], where: str, provisional_for: int) -> EnqueueRecord:
        now = self._unix_ms()
        if old is None:
            return EnqueueRecord(now, now + provisional_for if provisional_for else 0, where)
        before = old.before if old.where == where else old.where
        return EnqueueRecord(old.taken_at, now + provisional_for if provisional_for else 0, where, before)

    def start(self, key: str, owner: str, **options: Any) -> Start:
        ttl, limit, lock, copy, queue_key, order, reserve = StartArgs(**options)
        with self._mutex:
            record = self._live_record(copy)
            if record is not None and self._verdict(record, copy) is not None:
                verdict = self._claim(copy, write=True)  # it arrived: settle the record
                assert verdict is not None
                by = record.finished_by if verdict == CopyVerdict.DONE else None
                return Start(Acquisition(False, refused=verdict), duplicate_of=by)
            handed: list[tuple[str, bytes]] = []

            def ahead(entry: Entry) -> bool:
                promoted = self._promote_older(key, entry, copy.message_id, order, reserve)
                if promoted is not None:
                    handed.append(promoted)
                return promoted is not None

            got = self._take(key, owner, TakeArgs(ttl, limit, lock, copy.lock_args), ahead)
            promoted = handed[0][1] if handed else None
            if handed:  # as start.lua: the waiter it went to holds it
                got = got._replace(holder=handed[0][0])
            if not got.acquired:
                if self._in_line(copy):
                    return Start(got, in_line=True, promoted=promoted, free_in=self._free_in(key))
                self._claim(copy, write=True)
                return Start(got, promoted=promoted)
            self._claim(copy, write=True)
            record = self._live_record(copy)
            if not got.reentered and record is not None:
                record.runner, record.ran = owner, (copy.attempt, copy.via, copy.retries)
            if queue_key is None:
                return Start(got)
            return Start(got, queue_released=self._drop(queue_key, copy.message_id)[0])

    def _free_in(self, key: str) -> int:
        """The PTTL of start.lua: until the last holder or reservation runs out."""
        entry = self._entries.get(key)
        deadlines = [*entry.holders.values(), *entry.reserved.values()] if entry is not None else []
        return max(deadlines) - self._now_ms() if deadlines else -2

    def _in_line(self, copy: Copy) -> bool:
        waiters = self._live_waiters(copy.key)
        return waiters is not None and copy.message_id in waiters.order

    def _promote_older(
        self, key: str, entry: Entry, message_id: Optional[str], order: Optional[int], reserve: int
    ) -> Optional[tuple[str, bytes]]:
        """ahead() of start.lua: hand a free slot to the oldest waiter sent
        before ``order`` (None: any) but ``message_id``; its id and message.
        """
        waiters = self._live_waiters(key)
        if waiters is None or not waiters.order:
            return None
        head = min(waiters.order, key=lambda name: waiters.order[name][0])
        if head == message_id or (order is not None and waiters.order[head][0] >= order):
            return None
        entry.reserved[head] = self._now_ms() + reserve
        return head, waiters.order.pop(head)[1]

    def release(
        self, key: str, owner: str, *, hand_over: bool = True, succeeded: bool = False, reserve: int = DEFAULT_RESERVE
    ) -> Release:
        with self._mutex:
            held, present = self._drop(key, owner)
            ran = Copy(key, split_owner(owner).message_id)
            record = self._live_record(ran)
            if record is not None and record.runner == owner:
                attempt, via, retries = record.ran
                if succeeded:
                    self._finish(record, ran._replace(attempt=attempt, via=via, retries=retries), owner)
                else:
                    record.runner = None  # a failed run: its next copy runs
            return Release(held, self._promote(key, reserve) if hand_over and present else None)

    def _drop(self, key: str, owner: str) -> tuple[bool, bool]:
        """Remove ``owner``: whether it held a live slot, and whether it was there."""
        now = self._now_ms()
        entry = self._entries.get(key)
        deadline = entry.holders.pop(owner, None) if entry is not None else None
        if entry is None or deadline is None:
            return False, False
        entry.records.pop(owner, None)
        self._live(key, now)  # drops the entry with its last live holder
        return deadline > now, True

    def _live_waiters(self, key: str) -> Optional[Waiters]:
        # Like the Redis keys, the records of a key expire ttl after its last wait.
        waiters = self._waiters.get(key)
        if waiters is not None and waiters.expires_at <= self._now_ms():
            del self._waiters[key]
            return None
        return waiters

    def _live_record(self, copy: Copy) -> Optional[MessageRecord]:
        record = self._records.get((copy.key, copy.message_id))
        if record is not None and record.expires_at <= self._now_ms():
            del self._records[(copy.key, copy.message_id)]
            return None
        return record

    def _promote(self, key: str, reserve: int) -> Optional[bytes]:
        """Pop the longest waiter and reserve the freed slot for it."""
        waiters = self._live_waiters(key)
        if waiters is None or not waiters.order:
            return None
        promoted = self._promote_older(key, self._entries.setdefault(key, Entry()), None, None, reserve)
        return promoted[1] if promoted is not None else None

    def _unwait(self, copy: Copy) -> bool:
        """Withdraw a message's waiter: whether it was waiting."""
        waiters = self._live_waiters(copy.key)
        return waiters is not None and waiters.order.pop(copy.message_id, None) is not None

    def _claim(self, copy: Copy, *, write: bool) -> Optional[CopyVerdict]:
        """Why ``copy`` may not run, or None (_claim.lua); ``write`` settles its arrival."""
        record = self._live_record(copy)
        if record is None:
            return None
        if write:
            record.out.discard((copy.attempt, copy.via))
        verdict = self._verdict(record, copy)
        if verdict is None and write and not (copy.attempt == record.attempt and record.winner):
            record.attempt, record.winner = copy.attempt, copy.via
            if self._unwait(copy):
                record.out.discard((copy.attempt, "handoff"))
        if write and verdict is not None:
            self._settle(record)
        return verdict

    @staticmethod
    def _verdict(record: MessageRecord, copy: Copy) -> Optional[CopyVerdict]:
        if record.finished is not None and copy.retries <= record.finished:
            return CopyVerdict.DONE
        if copy.attempt < record.attempt:
            return CopyVerdict.STALE
        if copy.attempt == record.attempt and record.winner and record.winner != copy.via:
            return CopyVerdict.LOST
        return None

    def _finish(self, record: MessageRecord, copy: Copy, by: str) -> None:
        # finish() of _claim.lua: later copies with no more retries are duplicates.
        if self._unwait(copy):
            record.out.discard((record.attempt, "handoff"))
        record.attempt, record.winner, record.finished = copy.attempt, copy.via, copy.retries
        record.finished_as, record.runner, record.finished_by = (copy.attempt, copy.via, copy.retries), None, by
        self._settle(record)

    def _settle(self, record: MessageRecord) -> None:
        # A finished message's record lives only until no copy of it is to come.
        if record.finished is not None and not record.out:
            record.expires_at = min(record.expires_at, self._now_ms() + DUPLICATE_WINDOW)

    def join_line(self, copy: Copy, message: bytes, *, order: int, ttl: int) -> int:
        with self._mutex:
            recorded = self._live_record(copy)
            if recorded is not None and recorded.attempt >= copy.attempt:
                return 0  # sent again after a lost reply: as join_line.lua, it changes nothing
            expires_at = self._now_ms() + ttl
            record = recorded or MessageRecord(copy.attempt, "", expires_at)
            record.attempt, record.winner, record.expires_at = copy.attempt, "", expires_at
            record.out |= {(copy.attempt, "delay"), (copy.attempt, "handoff")}
            self._records[(copy.key, copy.message_id)] = record
            waiters = self._live_waiters(copy.key) or self._waiters.setdefault(copy.key, Waiters())
            waiters.order[copy.message_id] = (order, message)
            waiters.expires_at = expires_at
            return sum(1 for other, _ in waiters.order.values() if other < order)

    def claim(self, copy: Copy) -> bool:
        with self._mutex:
            # As claim.lua: the retired copy wins its attempt, and finishes nothing.
            if self._claim(copy, write=True) is not None:
                return False
            record = self._live_record(copy)
            if record is not None:
                record.runner = None
            # No copy of the message runs now: a slot reserved for it is free for the next in line.
            entry = self._entries.get(copy.key)
            if entry is not None and entry.reserved.pop(copy.message_id, None) is not None:
                self._live(copy.key, self._now_ms())
            return True

    def _fence(self, entry: Entry) -> int:
        self._last_fence = entry.fence = max(self._last_fence + 1, self._unix_us())
        return entry.fence

    def _superseded_by(self, key: str, owner: str, now: int) -> Optional[str]:
        record = self._superseded.get(key)
        if record is not None and record.expires_at <= now:
            del self._superseded[key]
            return None
        return record.by.get(owner) if record is not None else None

    def _replace(self, call: ReplaceArgs) -> Replacement:
        key, owner, ttl, lock, lock_args, keep_started, debounce, debounce_max, superseded_ttl, where = call
        with self._mutex:
            now = self._now_ms()
            entry = self._live(key, now)
            if entry is not None and owner in entry.holders:
                entry.holders[owner] = max(entry.holders[owner], now + ttl)
                entry.records[owner] = self._record(entry.records.get(owner), where, 0)
                return Replacement(ReplaceStatus.REENTERED, owner, 0, entry.fence)
            current = None
            if entry is not None:
                # As replace.lua: no live current message leaves only superseded, started slots.
                current = next(iter(entry.holders)) if entry.current is None else entry.current
                current = current if current in entry.holders else None
            status, burst = ReplaceStatus.ACQUIRED, now
            if entry is not None and current is not None:
                started = entry.started == current
                if started and keep_started:
                    return Replacement(ReplaceStatus.REFUSED, current, 0, entry.fence)
                if not started:
                    del entry.holders[current]
                    burst = entry.burst
                entry.previous_record = entry.records.pop(current, None) if not started else entry.records.get(current)
                record = self._superseded.setdefault(key, SupersededBy())
                record.by[current] = owner
                record.expires_at = max(record.expires_at, now + superseded_ttl)
                entry.superseded += 1
                entry.previous = current
                status = ReplaceStatus.REPLACED
            elif entry is None:
                entry = self._entries[key] = Entry()
            else:
                entry.superseded, entry.previous, entry.lock_args, entry.previous_record = 0, None, None, None
            delay = 0
            if debounce > 0:
                due = now + debounce
                if debounce_max > 0 and due > burst + debounce_max:
                    due = max(now, burst + debounce_max)
                delay = due - now
            entry.holders[owner] = now + ttl
            entry.records[owner] = EnqueueRecord(self._unix_ms(), 0, where)
            entry.current, entry.started, entry.burst = owner, None, burst
            entry.taken(lock, lock_args)
            return Replacement(status, current, delay, self._fence(entry))

    def _current(self, call: CurrentArgs) -> CurrentCheck:
        key, owner, reenter, ttl, lock, copy, where = call
        with self._mutex:
            now = self._now_ms()
            by = self._superseded_by(key, owner, now)
            if by is None and reenter and copy is not None:
                verdict = self._claim(copy, write=False)
                if verdict is not None:
                    return CurrentCheck(CurrentStatus.MAY_NOT_RUN, verdict.value)
            entry = self._live(key, now)
            if by is not None:
                if not reenter and entry is not None and entry.holders.pop(owner, None) is not None:
                    self._live(key, now)
                return CurrentCheck(CurrentStatus.SUPERSEDED, by)
            if not reenter:
                if entry is not None and entry.current == owner:
                    entry.started = owner
                return CurrentCheck(CurrentStatus.CURRENT)
            if entry is not None and owner in entry.holders:
                entry.holders[owner] = max(entry.holders[owner], now + ttl)
                if where is not None:
                    entry.records[owner] = self._record(entry.records.get(owner), where, 0)
                return CurrentCheck(CurrentStatus.REENTERED, owner)
            if entry is not None:
                return CurrentCheck(CurrentStatus.LAPSED, next(iter(entry.holders)))
            entry = self._entries[key] = Entry({owner: now + ttl}, lock, current=owner, burst=now)
            entry.records[owner] = EnqueueRecord(self._unix_ms(), 0, where or "")
            self._fence(entry)
            return CurrentCheck(CurrentStatus.CURRENT, owner)

    def unreplace(self, key: str, owner: str) -> Optional[str]:
        with self._mutex:
            now = self._now_ms()
            entry = self._live(key, now)
            previous = entry.previous if entry is not None and entry.current == owner in entry.holders else None
            if entry is None or previous is None or self._superseded_by(key, previous, now) != owner:
                return None
            del self._superseded[key].by[previous]
            entry.previous, entry.current = None, previous
            entry.superseded -= 1
            if previous not in entry.holders:
                entry.holders[previous] = entry.holders[owner]
                if entry.previous_record is not None:
                    entry.records[previous] = entry.previous_record
            entry.previous_record = None
            return previous

    def extend(self, locks: Sequence[tuple[str, str]], ttl: int) -> list[bool]:
        with self._mutex:
            now = self._now_ms()
            held = []
            for key, owner in locks:
                entry = self._live(key, now)
                if entry is not None and owner in entry.holders:
                    entry.holders[owner] = now + ttl
                held.append(entry is not None and owner in entry.holders)
            return held

    def confirm(self, locks: Sequence[tuple[str, str, int]]) -> list[bool]:
        with self._mutex:
            now = self._now_ms()
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
            now = self._now_ms()
            entry = self._live(key, now)
            if entry is None or entry.records.get(owner) != record:
                return False
            del entry.holders[owner]
            del entry.records[owner]
            self._live(key, now)
            return True

    def inspect(self, key: str) -> Optional[LockInfo]:
        with self._mutex:
            now = self._now_ms()
            entry = self._live(key, now)
            if entry is None or not entry.holders:
                return None
            offset = self._unix_ms() - now
            holders = {owner: deadline + offset for owner, deadline in entry.holders.items()}
            current = entry.current if entry.current in entry.holders else None
            kept = (entry.lock_args, entry.fence, current, entry.superseded, dict(entry.records))
            return LockInfo(key, entry.lock or None, holders, *kept)

    def scan(self, pattern: str) -> Iterator[str]:
        with self._mutex:
            now = self._now_ms()
            match = glob_pattern(pattern).fullmatch
            live = [(key, self._live(key, now)) for key in list(self._entries)]
            keys = [key for key, entry in live if entry is not None and entry.holders and match(key)]
        return iter(sorted(keys))

    def delete(self, key: str) -> bool:
        with self._mutex:
            # As DEL: a key whose slots and reservations all ran out is no longer there.
            live = self._live(key, self._now_ms())
            self._entries.pop(key, None)
            return live is not None

    def delete_prefix(self, prefix: str) -> int:
        with self._mutex:
            dropped = 0
            for table in (self._entries, self._waiters, self._superseded):
                for key in [key for key in table if key.startswith(prefix)]:
                    del table[key]
                    dropped += 1
            for record in [record for record in self._records if record[0].startswith(prefix)]:
                del self._records[record]
                dropped += 1
            return dropped

    def waiters(self, key: str) -> list[Waiter]:
        with self._mutex:
            waiting = self._live_waiters(key)
            lines = sorted((order, message_id) for message_id, (order, _) in waiting.order.items()) if waiting else []
        return [Waiter(message_id, order) for order, message_id in lines]
