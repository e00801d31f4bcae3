"""The core of the lock backend interface: what every backend has.

The core is :class:`LockBackend`, with the operators' reads of
:class:`LockReads`: what every lock type needs.  What only some backends
can do are the capabilities (:mod:`.capabilities`), and the records the
verbs take and return are in :mod:`.records`.

A lock is a set of holders under one key.  Each holder is an owner
string with its own deadline, so ``limit`` holders may share a key and
a dead holder frees only its own slot.  Every verb checks the owner,
and every deadline is enforced by the backend's own clock.
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
    """The regular expression of a key glob, as :meth:`LockReads.scan`
    reads it: ``*`` matches any run of characters, ``?`` one character,
    ``[abc]`` one of a set (``[a-z]`` a range, ``[^abc]`` none of them),
    and ``\\`` makes the next character plain.  The pattern matches the
    whole key.  It is Redis's ``SCAN MATCH`` glob, so that every backend
    reads a pattern as the Redis backend does.
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
    """What operators read of a backend: no verb here changes a lock.
    :class:`~dramatiq_unique.ops.admin.LockAdmin` and the dashboard read
    through these; the middleware never does.
    """

    @abc.abstractmethod
    def inspect(self, key: str) -> Optional[LockInfo]:
        """Describe ``key``, or None when nobody holds it."""

    @abc.abstractmethod
    def scan(self, pattern: str) -> Iterator[str]:
        """Iterate over the held keys matching ``pattern``, a glob read
        as :func:`glob_pattern` says, each key once.  A backend may also
        yield the keys it keeps beside a lock (waiters, records), which
        share the lock key as their prefix: callers that want locks
        only match the phase at the end (``*:run``, ``*:queue``).
        """

    def waiters(self, key: str) -> list[Waiter]:
        """The messages waiting for run lock ``key``, first in line
        first; for operators.  A backend without waiting lists has none.
        """
        return []

    def describe(self) -> str:
        """A short description for error messages, e.g. a URL without
        its password.
        """
        return type(self).__name__

    def close(self) -> None:
        """Close the connections this backend opened itself (not a
        client it was given); a later call opens them again.  Nothing to
        close by default.
        """
        return None

    def check(self, key: str) -> None:
        """Make one read that changes nothing, to find out whether the
        backend answers: a worker does at boot, the CLI before it reads.

        Parameters:
          key(str): A key to read, under the locks' prefix (so that a
            client allowed only those keys may read it); nobody holds it.

        Raises:
          Exception: What the backend's client raises when it cannot be
            reached, e.g. redis-py's ``ConnectionError: Error -2
            connecting to no-such-host.invalid:6379. Name or service not
            known.``
        """
        self.inspect(key)


class LockBackend(LockReads):
    """The core of every lock backend.  Durations are in milliseconds.

    The verbs are grouped by who calls them: the hot path (every job
    makes these) and operators' writes.  Operators' reads are
    :class:`LockReads`; what only some backends can do are the
    capabilities below (:class:`Reschedules`, :class:`NewestWins`,
    :class:`SendsWithPublish`, :class:`BatchedReleases`,
    :class:`RenewsNatively`).
    """

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
        """Take one of ``limit`` slots of ``key`` for ``owner`` until
        ``ttl`` from now.  Acquiring again with the same owner succeeds
        and keeps the later of the two deadlines.

        Parameters:
          key(str): The lock key.
          owner(str): The holder's identity.
          ttl(int): How long the slot is held, in milliseconds.
          limit(int): How many owners may hold the key at once.
          lock(str): The lock type, recorded for operators.
          lock_args(str): JSON of the lock args, recorded if given.
          provisional(int): When above 0 and below ``ttl``, a new slot,
            or one still provisional, lasts this long only, until
            :meth:`confirm` gives it ``ttl``.  A confirmed slot that is
            re-entered takes ``ttl`` at once.
          where(str): Keep an :class:`EnqueueRecord` of the owner, with
            this as where its message is being published; None keeps
            none (run locks).
          copy(Copy): A re-enqueued copy of a message that may have been
            rescheduled: nothing is taken when it may not run.  A
            backend without :class:`Reschedules` keeps no records, so
            every copy may run.
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
        """Claim the delivered ``copy`` (see :meth:`Reschedules.claim`), take a slot
        of the run lock ``key`` for ``owner``, and release the enqueue
        lock ``queue_key`` of the message once the slot is taken: one
        round trip for everything a delivery takes before it runs.

        A slot reserved for another message counts as held.  A free
        slot goes to the oldest waiter in line instead, when one was
        sent before ``copy`` (``order``, see :meth:`Reschedules.join_line`; None: after
        every waiter): it is reserved for it for ``reserve`` ms and its
        message returned in :attr:`Start.promoted`.  A copy whose
        message is still in line when the slot is not its to take
        changes nothing (:attr:`Start.in_line`).
        """

    @abc.abstractmethod
    def release(
        self, key: str, owner: str, *, hand_over: bool = True, succeeded: bool = False, reserve: int = DEFAULT_RESERVE
    ) -> Release:
        """Remove ``owner`` from ``key``, and hand the freed slot to the
        longest waiter of ``key``, if any (see :meth:`Reschedules.join_line`), reserved
        for that waiter's message until a copy of it takes it or
        ``reserve`` ms have passed.

        Parameters:
          hand_over(bool): False leaves the waiters waiting, for a caller
            that cannot enqueue the promoted message (an operator).
          succeeded(bool): The owner's run succeeded and leaves nothing
            to do: it finishes its message, so that a later copy with no
            more retries is skipped as a duplicate.  False (a failed run,
            or an outcome unknown) leaves the message's next copy to run.
          reserve(int): In milliseconds.
        """

    def release_many(self, locks: Sequence[tuple[Any, ...]]) -> list[Union[Release, Exception]]:
        """Release each ``(key, owner)`` (or :class:`Releasing`) and hand
        its slot over, as :meth:`release` does, in as few round trips as
        the backend can (one each here; one in all with
        :class:`BatchedReleases`).

        Returns:
          list: per lock, its :class:`Release`, or the exception its
          release raised.
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
        """Move the deadline of each ``(key, owner)`` to ``ttl`` from
        now, in one round trip.  An owner whose slot lapsed or was taken
        is not extended.

        Returns:
          list[bool]: per lock, whether it is still held.
        """

    @abc.abstractmethod
    def confirm(self, locks: Sequence[tuple[str, str, int]]) -> list[bool]:
        """Give each provisional ``(key, owner, ttl)`` slot its full
        lifetime: a deadline of at least ``ttl`` from now, in one round
        trip.  A slot released meanwhile, or lapsed, is never revived.

        Returns:
          list[bool]: per lock, whether it is still held.
        """

    # Operators' writes -----------------------------------------------

    @abc.abstractmethod
    def reap(self, key: str, owner: str, record: EnqueueRecord) -> bool:
        """Release ``owner``'s slot of ``key`` if its enqueue record is
        still ``record``: a reaper checked that record's message and
        found it nowhere.

        Returns:
          bool: True when a live slot was released.
        """

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Drop ``key`` and all its holders: an operator's override."""

    @abc.abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Drop every key that starts with ``prefix`` (a plain string,
        not a glob): locks, and what the backend keeps beside them
        (waiters, message records, superseded records).  For tests and
        for operators clearing an application's keys.

        Returns:
          int: How many keys were dropped (as the backend counts them).
        """


def call_backend(backend: LockReads, doing: str, call: Callable[..., T], *args: Any) -> T:
    """Run one call of ``backend``, turning its failures into
    :class:`LockBackendError` with a one-line message that says what it
    was ``doing``, as the operators' listing words them.
    """
    try:
        return call(*args)
    except UniqueError:
        raise
    except Exception as e:
        where = backend.describe()
        reason = " ".join(str(e).split()) or type(e).__name__
        raise LockBackendError(f"Lock backend {where} failed to {doing}: {reason}", backend=where) from e


class PrefixLocks:
    """The live locks under one prefix, read through a backend's reads:
    what a worker's periodic reaper checks, and what the operators'
    :class:`~dramatiq_unique.ops.admin.LockAdmin` lists.  Failures are
    :class:`LockBackendError` (see :func:`call_backend`).

    Parameters:
      backend(LockBackend): Where the locks live.
      prefix(str): The middleware's prefix.
    """

    def __init__(self, backend: LockBackend, *, prefix: str) -> None:
        self.backend = backend
        self.prefix = prefix

    def locks(
        self, *, actor: Optional[str] = None, pattern: Optional[str] = None, phase: Optional[str] = None
    ) -> Iterator[ListedLock]:
        """Iterate over the live locks, in ``SCAN`` order, each once,
        filtered as :meth:`~dramatiq_unique.ops.admin.LockAdmin.locks`
        says (``pattern`` is read by :func:`glob_pattern`).
        """
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
        """Run one backend call (see :func:`call_backend`)."""
        return call_backend(self.backend, doing, call, *args)
