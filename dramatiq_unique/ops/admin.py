"""The operator's view of the locks: list, inspect and release them.

Lock keys look like ``{prefix}:{actor}:{<digest>}:queue`` (an enqueue
lock, owned by a message id) or ``...:run`` (a run lock, owned by
``<message_id>/<nonce>``).  Keys are found with ``SCAN`` through
:meth:`LockBackend.scan`, never ``KEYS``, and the ``:wait``,
``:bodies``, ``:m:<message id>`` and ``:superseded`` companions of a
lock are never listed or touched.

Examples:
  >>> admin = LockAdmin(from_url("redis://127.0.0.1:6379/0"))
  >>> for lock in admin.locks(actor="sync_account_balance"):
  ...     print(lock.digest, lock.phase, lock.holders)
  >>> admin.release("9f86d081884c7d659a2feaa0c55ad015", holder="b4a1...")
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
    """One holder of a lock.

    Attributes:
      owner(str): The owner string, as the backend stores it.
      message_id(str): The message that holds the slot.
      deadline(int): When the slot expires, in Unix milliseconds.
      record(EnqueueRecord): When it was taken (every lock type and
        strategy records it), and for an enqueue lock whether it is
        still provisional and where its message went.
    """

    owner: str
    message_id: str
    deadline: int
    record: Optional[EnqueueRecord] = None

    @property
    def taken_at(self) -> Optional[int]:
        """When the slot was taken, in Unix milliseconds, if recorded."""
        return self.record.taken_at if self.record is not None else None

    @property
    def queue(self) -> Optional[str]:
        """The queue an enqueue-lock holder's message was last
        published to (without ``.DQ``), if recorded.
        """
        return (self.record.queue or None) if self.record is not None else None

    @property
    def provisional(self) -> bool:
        """True while the slot waits for its message's publish to be
        confirmed: it lapses at its (short) deadline unless confirmed.
        """
        return self.record is not None and self.record.provisional_until > 0

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict, ``record`` read as its ``taken_at``,
        ``provisional`` and ``queue``.
        """
        names = ("owner", "message_id", "deadline", "taken_at", "provisional", "queue")
        return {name: getattr(self, name) for name in names}


@dataclass(frozen=True)
class Lock:
    """One live lock key.

    Attributes:
      key(str): The full backend key.
      actor(str): The actor's name (``@any`` for locks taken with
        ``unique_across_actors``); for a key an older release wrote for
        a name holding ``{}()%`` or a leading ``@``, which may name
        either of two actors, its actor part as written.
      digest(str): The 32 hex characters inside the braces.
      phase(str): ``queue`` for an enqueue lock, ``run`` for a run lock.
      lock(str): The lock type that took it, e.g. ``while_executing``.
      holders(tuple[Holder, ...]): Its holders, soonest deadline first.
      lock_args(str): JSON of the lock args, when they were recorded.
      fence(int): The last fencing token handed out.
      waiting(tuple[Waiter, ...]): For a run lock, the messages waiting
        to be handed it, first in line first.
      current(str): Under ``on_conflict="replace"`` or ``debounce``,
        the message id of the newest send, the one that runs.
      superseded(int): How many messages sends of this key superseded
        since it was taken.
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
    """The digest named by ``text``: a digest itself, or a lock key.

    Raises:
      UnknownLock: when ``text`` is neither.
    """
    found = digest_in(text)
    if found is None:
        raise UnknownLock(
            f"{text.strip()!r} is not a digest: expected the 32 hex characters inside the braces of a lock key."
        )
    return found


class LockAdmin:
    """Lists, inspects and releases the locks under one prefix.

    Parameters:
      backend(LockBackend): Where the locks live.
      prefix(str): The prefix the middleware was given.

    Every method raises :class:`LockBackendError` when the backend
    fails, e.g. when Redis cannot be reached.

    Note:
      Releasing a run-lock holder does not hand its slot to the key's
      longest waiter, as a worker would: this process has no broker to
      enqueue it.  The waiter runs when its delayed copy arrives,
      within ``reschedule_delay``.
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
        """The live locks that :meth:`PrefixLocks.locks` lists for these
        filters, in ``SCAN`` order, with the waiters of each run lock.
        """
        for listed in self.listing.locks(actor=actor, pattern=pattern, phase=phase):
            waiting = []
            if listed.phase == RUN:
                waiting = self.call(f"list the waiters of {listed.key!r}", self.backend.waiters, listed.key)
            key, actor_name, digest, lock_phase, lock, lock_args, slots, info = listed
            holders = tuple(Holder(h.owner, message_id_of(h.owner) or h.owner, h.deadline, h.record) for h in slots)
            fields = (info.fence, tuple(waiting), info.current, info.superseded)
            yield Lock(key, actor_name, digest, lock_phase, lock, holders, lock_args, *fields)

    def inspect(self, digest: str) -> list[Lock]:
        """Describe the live locks of one digest (or whole lock key): its
        enqueue lock, its run lock, or both.

        Raises:
          UnknownLock: when no live lock has this digest.
        """
        digest = digest_of(digest)
        glob = lock_key_glob(prefix=self.prefix, digest=digest)
        found = sorted((lock for lock in self.locks(pattern=glob) if lock.digest == digest), key=_phase_order)
        if not found:
            raise UnknownLock(f"No lock has digest {digest} under prefix {self.prefix!r}.")
        return found

    def release(self, digest: str, *, holder: Optional[str] = None, phase: Optional[str] = None) -> list[str]:
        """Release the locks of a digest (or whole lock key), or one of
        their holders.

        Parameters:
          holder(str): Release only this holder: its owner string or its
            message id.  Its release is owner-checked, so a slot that was
            meanwhile taken by someone else is left alone.
          phase(str): Only the ``queue`` or the ``run`` lock.

        Returns:
          list[str]: The keys that were deleted, or, with ``holder``,
          ``"key owner"`` for each released slot.

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
        """Release every enqueue-lock holder whose message was last
        published to ``queue`` (or its delay queue), as recorded by the
        lock: after a purge on RabbitMQ, where :meth:`reap` cannot look
        messages up.  Each release is owner-checked.

        Returns:
          list[str]: ``"key owner"`` for each released slot.
        """
        return self._release_slots(self.queue_holders(queue))

    def queue_holders(self, queue: str) -> list[tuple[str, str]]:
        """The ``(key, owner)`` of every enqueue-lock holder whose
        message was last published to ``queue``, as recorded.
        """
        locks = self.locks(phase=QUEUE)
        return [(lock.key, h.owner) for lock in locks for h in lock.holders if h.record and h.record.queue == queue]

    def _release_slots(self, slots: list[tuple[str, str]]) -> list[str]:
        """Release each ``(key, owner)`` slot, owner-checked; return
        ``"key owner"`` for each that was still held.
        """
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
        """Find the enqueue locks whose message is in no queue, delay
        queue, dead-letter queue or worker of the Redis broker, and
        release them when ``release`` (see :mod:`dramatiq_unique.worker.reap`).

        Parameters:
          broker_client(redis.Redis): A client of the broker's Redis.
          release(bool): False (the default) only reports them.
          actor(str): Only the locks of this actor.
          min_age(int): Leave locks younger than this alone, in ms.
          batch(int): Locks looked up per broker transaction.
        """
        min_age = DEFAULT_MIN_AGE if min_age is None else min_age
        reaper = Reaper(self, RedisQueues(broker_client), min_age=min_age, batch=batch or DEFAULT_BATCH)
        return reaper.run(release=release, actor=actor)


def _phase_order(lock: Lock) -> int:
    return PHASES.index(lock.phase)
