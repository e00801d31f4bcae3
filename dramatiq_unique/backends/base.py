""":class:`LockBackend`, the lock backend interface's core, and operators'
reads (:class:`LockReads`); see :mod:`.capabilities` and :mod:`.records`.

A lock is a set of holders under one key, each an owner with its own
deadline (by the backend's clock), so ``limit`` holders may share a key
and a dead holder frees only its own slot.  Every verb checks the owner.
"""

from __future__ import annotations

import abc
import re
from typing import Any, Callable, Iterator, Optional, Sequence, TypeVar, Union

from ..errors import LockBackendError, UniqueError
from ..model.wire import EnqueueRecord, actor_scope, lock_key_glob, parse_lock_key
from .records import (
    DEFAULT_RESERVE,
    Acquisition,
    Copy,
    HeldSlot,
    ListedLock,
    LockInfo,
    Release,
    Releasing,
    Start,
    Waiter,
)

T = TypeVar("T")


def glob_pattern(glob: str) -> "re.Pattern[str]":
    """The regular expression, matching whole keys, of a key glob: Redis's
    ``SCAN MATCH`` glob (``*``, ``?``, ``[a-z]``, ``[^abc]``, ``\\`` to
    escape), so that every backend reads a pattern as the Redis backend does.
    """
    parts, i = [], 0
    while i < len(glob):
        char = glob[i]
        if char == "\\" and i + 1 < len(glob):
            parts.append(re.escape(glob[i + 1]))
            i += 2
            continue
        if char == "[":
            end = glob.find("]", i + 2 if glob[i + 1 : i + 2] == "^" else i + 1)
            if end > 0:
                inner = glob[i + 1 : end]
                negate = inner.startswith("^")
                body = "".join("\\" + c if c in "\\^[]" else c for c in (inner[1:] if negate else inner))
                parts.append(f"[{'^' if negate else ''}{body}]")
                i = end + 1
                continue
        parts.append(".*" if char == "*" else "." if char == "?" else re.escape(char))
        i += 1
    return re.compile("".join(parts), re.DOTALL)


class LockReads(abc.ABC):
    """What operators read of a backend (never the middleware): no verb here changes a lock."""

    @abc.abstractmethod
    def inspect(self, key: str) -> Optional[LockInfo]:
        """Describe ``key``, or None when nobody holds it."""

    @abc.abstractmethod
    def scan(self, pattern: str) -> Iterator[str]:
        """Iterate once over each held key matching glob ``pattern``
        (:func:`glob_pattern`).  Keys kept beside a lock (waiters, records)
        may come too: match the phase (``*:run``) to get locks only.
        """

    def waiters(self, key: str) -> list[Waiter]:
        """The messages waiting for run lock ``key``, first in line first."""
        return []

    def describe(self) -> str:
        """A short description for error messages, e.g. a URL without its password."""
        return type(self).__name__

    def close(self) -> None:
        """Close the connections this backend opened (not a client given); a later call reopens."""
        return None

    def check(self, key: str) -> None:
        """Read ``key`` (nobody's, under the locks' prefix, so that a client
        allowed only those keys may) to find out whether the backend answers;
        raises what its client does when unreachable (``redis.ConnectionError``).
        """
        self.inspect(key)


class LockBackend(LockReads):
    """The core of every lock backend: the hot path and operators' writes.  Durations are in ms."""

    # The hot path: every job -----------------------------------------

    @abc.abstractmethod
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
        copy: Optional[Copy] = None,
    ) -> Acquisition:
        """Take one of ``limit`` slots of ``key`` for ``owner`` until ``ttl``
        from now.  The same owner again re-enters, keeping the later deadline.

        Parameters:
          lock(str): The lock type, recorded for operators.
          lock_args(str): JSON of the lock args, recorded if given.
          provisional(int): When above 0 and below ``ttl``, a new or still
            provisional slot lasts this long only, until :meth:`confirm`
            gives it ``ttl``; a confirmed slot re-entered takes ``ttl``.
          where(str): Where the owner's message is being published, kept in
            its :class:`EnqueueRecord`; None keeps none (run locks).
          copy(Copy): A re-enqueued copy of a maybe rescheduled message:
            nothing is taken when it may not run (never without
            :class:`Reschedules`, which keeps the records).
        """

    @abc.abstractmethod
    def start(
        self,
        key: str,
        owner: str,
        *,
        ttl: int,
        limit: int,
        lock: str,
        copy: Copy,
        queue_key: Optional[str] = None,
        order: Optional[int] = None,
        reserve: int = DEFAULT_RESERVE,
    ) -> Start:
        """Claim the delivered ``copy`` (:meth:`Reschedules.claim`), take a
        slot of run lock ``key`` for ``owner``, then release the enqueue
        lock ``queue_key``: one round trip for all a delivery takes.

        A slot reserved for another message counts as held.  A free slot
        goes instead to the oldest waiter sent before ``copy`` (``order`` as in
        :meth:`Reschedules.join_line`; None: after all), reserved ``reserve``
        ms, its message in :attr:`Start.promoted`.  A copy still in line for a
        slot not its own changes nothing (:attr:`Start.in_line`).
        """

    @abc.abstractmethod
    def release(
        self, key: str, owner: str, *, hand_over: bool = True, succeeded: bool = False, reserve: int = DEFAULT_RESERVE
    ) -> Release:
        """Remove ``owner`` from ``key``, and hand the freed slot to its
        longest waiter (:meth:`Reschedules.join_line`), reserved until a
        copy of that message takes it or ``reserve`` ms pass.

        Parameters:
          hand_over(bool): False leaves the waiters waiting, for a caller
            that cannot enqueue the promoted message (an operator).
          succeeded(bool): The run succeeded: it finishes its message, so
            that a later copy with no more retries is skipped as a
            duplicate.  False (failed, or unknown) lets the next copy run.
        """

    def release_many(self, locks: Sequence[tuple[Any, ...]]) -> list[Union[Release, Exception]]:
        """:meth:`release` each ``(key, owner)`` (or :class:`Releasing`), in
        one round trip each here, one in all with :class:`BatchedReleases`:
        per lock, its :class:`Release`, or the exception it raised.
        """
        outcomes: list[Union[Release, Exception]] = []
        for lock in locks:
            one = Releasing(*lock)
            try:
                outcomes.append(self.release(one.key, one.owner, succeeded=one.succeeded, reserve=one.reserve))
            except Exception as e:
                outcomes.append(e)
        return outcomes

    @abc.abstractmethod
    def extend(self, locks: Sequence[tuple[str, str]], ttl: int) -> list[bool]:
        """Move each ``(key, owner)``'s deadline to ``ttl`` from now, in one
        round trip (not a lapsed or taken slot's): per lock, whether held.
        """

    @abc.abstractmethod
    def confirm(self, locks: Sequence[tuple[str, str, int]]) -> list[bool]:
        """Give each provisional ``(key, owner, ttl)`` slot at least ``ttl``
        from now, in one round trip, never reviving one: per lock, whether held.
        """

    # Operators' writes -----------------------------------------------

    @abc.abstractmethod
    def reap(self, key: str, owner: str, record: EnqueueRecord) -> bool:
        """Release ``owner``'s slot of ``key`` if its enqueue record is still
        ``record``, whose message a reaper found nowhere: True if it was live.
        """

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Drop ``key`` and all its holders: an operator's override."""

    @abc.abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Drop every key starting with ``prefix`` (not a glob), with what is
        kept beside it (waiters, records): for tests and operators.  Returns
        how many keys were dropped (as the backend counts them).
        """


def call_backend(backend: LockReads, doing: str, call: Callable[..., T], *args: Any) -> T:
    """Run one call of ``backend``, a failure raised as a one-line :class:`LockBackendError` of ``doing``."""
    try:
        return call(*args)
    except UniqueError:
        raise
    except Exception as e:
        where = backend.describe()
        reason = " ".join(str(e).split()) or type(e).__name__
        raise LockBackendError(f"Lock backend {where} failed to {doing}: {reason}", backend=where) from e


class PrefixLocks:
    """The live locks under the middleware's ``prefix``, as the reaper checks
    them and :class:`~dramatiq_unique.ops.admin.LockAdmin` lists them;
    failures are :class:`LockBackendError` (:func:`call_backend`).
    """

    def __init__(self, backend: LockBackend, *, prefix: str) -> None:
        self.backend = backend
        self.prefix = prefix

    def locks(
        self, *, actor: Optional[str] = None, pattern: Optional[str] = None, phase: Optional[str] = None
    ) -> Iterator[ListedLock]:
        """Iterate once over each live lock, filtered as :meth:`~dramatiq_unique.ops.admin.LockAdmin.locks` says."""
        scope = actor_scope(actor) if actor is not None else None
        glob = pattern or lock_key_glob(prefix=self.prefix, scope=scope, phase=phase)
        keys = self.call(f"scan {glob!r}", self.backend.scan, glob)
        while True:
            key = self.call(f"scan {glob!r}", next, keys, None)
            if key is None:
                return
            parts = parse_lock_key(key, prefix=self.prefix)
            if parts is None or scope not in (None, parts.scope) or phase not in (None, parts.phase):
                continue  # a companion key, or one the glob matched beyond its scope
            info = self.call(f"inspect {key!r}", self.backend.inspect, key)
            if info is not None:
                slots = [HeldSlot(owner, deadline, info.records.get(owner)) for owner, deadline in info.holders.items()]
                holders = tuple(sorted(slots, key=lambda slot: (slot.deadline, slot.owner)))
                actor = parts.scope if parts.actor is None else parts.actor
                yield ListedLock(key, actor, parts.digest, parts.phase, info.lock, info.lock_args, holders, info)

    def call(self, doing: str, call: Callable[..., T], *args: Any) -> T:
        return call_backend(self.backend, doing, call, *args)
