"""The operator's view of the locks: list, inspect and release them.

Keys are found with ``SCAN`` (:meth:`LockBackend.scan`), never ``KEYS``; a lock's companion keys
are never listed or touched.  See docs/operations.md, "The same in Python".
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from ..backends.base import LockBackend, PrefixLocks
from ..backends.records import EnqueueRecord, Waiter
from ..errors import UniqueError
from ..model.wire import PHASES, QUEUE, RUN, check_key, digest_in, lock_key_glob, message_id_of
from ..settings import DEFAULT_PREFIX
from ..worker.reap import DEFAULT_BATCH, DEFAULT_MIN_AGE, Reaper, ReapReport, RedisQueues


class UnknownLock(UniqueError, LookupError):
    """Raised when no live lock, or no such holder, has a digest."""


@dataclass(frozen=True)
class Holder:
    """One holder of a lock: ``owner`` as stored, the ``message_id`` of the slot, its ``deadline``
    (Unix ms), and the ``record`` of when it was taken, whether provisional and where its message went.
    """

    owner: str
    message_id: str
    deadline: int
    record: Optional[EnqueueRecord] = None

    @property
    def taken_at(self) -> Optional[int]:
        """When the slot was taken, in Unix ms, if recorded."""
        return self.record.taken_at if self.record is not None else None

    @property
    def queue(self) -> Optional[str]:
        """The queue its message was last published to (without ``.DQ``), if recorded."""
        return (self.record.queue or None) if self.record is not None else None

    @property
    def provisional(self) -> bool:
        """True until its publish is confirmed: meanwhile it lapses at its (short) deadline."""
        return self.record is not None and self.record.provisional_until > 0

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict, ``record`` read as its ``taken_at``, ``provisional`` and ``queue``."""
        names = ("owner", "message_id", "deadline", "taken_at", "provisional", "queue")
        return {name: getattr(self, name) for name in names}


@dataclass(frozen=True)
class Lock:
    """One live lock key: ``lock`` is the lock type that took it, ``holders`` soonest deadline first,
    ``fence`` the last fencing token, ``waiting`` a run lock's waiters, first in line first.  Under
    replace or debounce, ``current`` is the newest send (the one that runs) and ``superseded`` counts
    the messages it superseded.

    ``actor`` is ``@any`` across actors; for an old-format key that may name either of two actors,
    it is the actor part as written.
    """

    key: str
    actor: str
    digest: str
    phase: str
    lock: Optional[str]
    holders: tuple[Holder, ...]
    lock_args: Optional[str] = None
    fence: int = 0
    waiting: tuple[Waiter, ...] = ()
    current: Optional[str] = None
    superseded: int = 0

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict, with the lock args decoded."""
        data = {name: getattr(self, name) for name in ("key", "actor", "digest", "phase", "lock", "fence")}
        waiting = [{"message_id": w.message_id, "since": w.sent_at, "order": w.order} for w in self.waiting]
        data.update(lock_args=_decoded(self.lock_args), holders=[h.as_dict() for h in self.holders], waiting=waiting)
        return {**data, "current": self.current, "superseded": self.superseded}


def _decoded(lock_args: Optional[str]) -> Any:
    if lock_args is None:
        return None
    try:
        return json.loads(lock_args)
    except ValueError:
        return lock_args


def digest_of(text: str) -> str:
    """The digest named by ``text``: a digest itself, or a lock key; :class:`UnknownLock` if neither."""
    found = digest_in(text)
    if found is None:
        raise UnknownLock(
            f"{text.strip()!r} is not a digest: expected the 32 hex characters inside the braces of a lock key."
        )
    return found


class LockAdmin:
    """Lists, inspects and releases the locks under one prefix: the one the middleware was given.

    Every method raises :class:`LockBackendError` when the backend fails.

    Note:
      Releasing a run-lock holder does not hand its slot to the longest waiter, as a worker would:
      there is no broker here to enqueue it.  The waiter runs when its delayed copy arrives.
    """

    def __init__(self, backend: LockBackend, *, prefix: str = DEFAULT_PREFIX) -> None:
        self.backend = backend
        self.prefix = prefix
        self.listing = PrefixLocks(backend, prefix=prefix)
        self.call = self.listing.call

    def check(self) -> None:
        """Make one backend call, to fail early when it is unreachable."""
        self.call("answer", self.backend.check, check_key(self.prefix))

    def locks(
        self, *, actor: Optional[str] = None, pattern: Optional[str] = None, phase: Optional[str] = None
    ) -> Iterator[Lock]:
        """The live locks for these filters, in ``SCAN`` order, with each run lock's waiters."""
        for listed in self.listing.locks(actor=actor, pattern=pattern, phase=phase):
            waiting = []
            if listed.phase == RUN:
                waiting = self.call(f"list the waiters of {listed.key!r}", self.backend.waiters, listed.key)
            key, actor_name, digest, lock_phase, lock, lock_args, slots, info = listed
            holders = tuple(Holder(h.owner, message_id_of(h.owner) or h.owner, h.deadline, h.record) for h in slots)
            fields = (info.fence, tuple(waiting), info.current, info.superseded)
            yield Lock(key, actor_name, digest, lock_phase, lock, holders, lock_args, *fields)

    def inspect(self, digest: str) -> list[Lock]:
        """The live locks (enqueue, run, or both) of one digest or lock key; :class:`UnknownLock` if none."""
        digest = digest_of(digest)
        glob = lock_key_glob(prefix=self.prefix, digest=digest)
        found = [lock for lock in self.locks(pattern=glob) if lock.digest == digest]
        found.sort(key=lambda lock: PHASES.index(lock.phase))
        if not found:
            raise UnknownLock(f"No lock has digest {digest} under prefix {self.prefix!r}.")
        return found

    def release(self, digest: str, *, holder: Optional[str] = None, phase: Optional[str] = None) -> list[str]:
        """Release the locks of a digest or lock key, or only its ``phase`` lock, or only ``holder``
        (owner or message id), owner-checked so that a slot taken meanwhile is left alone.  Return the
        deleted keys, or ``"key owner"`` of each released slot.

        Raises:
          UnknownLock: when the digest has no such lock or holder.
        """
        if phase is not None and phase not in PHASES:
            raise ValueError(f"phase={phase!r} is invalid. Valid choices: {', '.join(PHASES)}.")
        locks = [lock for lock in self.inspect(digest) if phase in (None, lock.phase)]
        if not locks:
            raise UnknownLock(f"Digest {digest_of(digest)} has no {phase} lock under prefix {self.prefix!r}.")
        if holder is None:
            return self._delete(locks)
        slots = [(lock.key, h.owner) for lock in locks for h in lock.holders if holder in (h.owner, h.message_id)]
        if not slots:
            raise UnknownLock(f"Digest {locks[0].digest} has no holder {holder!r}.")
        return self._release_slots(slots)

    def release_actor(self, actor: str) -> list[str]:
        """Delete every lock of one actor; return the deleted keys."""
        return self._delete(list(self.locks(actor=actor)))

    def release_queue(self, queue: str) -> list[str]:
        """Release, owner-checked, the :meth:`queue_holders` of ``queue`` (after a purge on RabbitMQ,
        where :meth:`reap` cannot look messages up); return ``"key owner"`` of each.
        """
        return self._release_slots(self.queue_holders(queue))

    def queue_holders(self, queue: str) -> list[tuple[str, str]]:
        """``(key, owner)`` of each enqueue-lock holder last published to ``queue`` or its delay queue."""
        locks = self.locks(phase=QUEUE)
        return [(lock.key, h.owner) for lock in locks for h in lock.holders if h.record and h.record.queue == queue]

    def _release_slots(self, slots: list[tuple[str, str]]) -> list[str]:
        """Release each ``(key, owner)`` slot, owner-checked; return ``"key owner"`` of those still held."""
        release = functools.partial(self.backend.release, hand_over=False)
        held = [self.call(f"release {key!r}", release, key, owner).held for key, owner in slots]
        return [f"{key} {owner}" for (key, owner), was_held in zip(slots, held) if was_held]

    def _delete(self, locks: list[Lock]) -> list[str]:
        return [lock.key for lock in locks if self.call(f"delete {lock.key!r}", self.backend.delete, lock.key)]

    def reap(
        self,
        broker_client: Any,
        *,
        release: bool = False,
        actor: Optional[str] = None,
        min_age: Optional[int] = None,
        batch: Optional[int] = None,
    ) -> ReapReport:
        """Find the enqueue locks whose message is nowhere in the Redis broker (``broker_client``), and
        release them when ``release``: only ``actor``'s if given, none younger than ``min_age`` ms,
        ``batch`` per broker transaction.
        """
        min_age = DEFAULT_MIN_AGE if min_age is None else min_age
        reaper = Reaper(self, RedisQueues(broker_client), min_age=min_age, batch=batch or DEFAULT_BATCH)
        return reaper.run(release=release, actor=actor)
