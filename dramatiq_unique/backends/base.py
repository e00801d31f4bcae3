"""The lock backend interface.

A lock is a set of holders under one key.  Each holder is an owner
string with its own deadline, so ``limit`` holders may share a key and
a dead holder frees only its own slot.  Every verb checks the owner,
and every deadline is enforced by the backend's own clock.

The outcomes that every job makes (:class:`Acquisition`, :class:`Copy`,
:class:`Start`, :class:`Release`) are named tuples: immutable like the
frozen dataclasses here, at a third of their cost to build.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass, field
from typing import Any, Iterator, NamedTuple, Optional, Sequence, Union


class _Named(str, enum.Enum):
    """An outcome named by its text: equal to that text, and printed as
    it (in log lines too), as the plain strings it replaces were.
    """

    def __str__(self) -> str:
        return str(self.value)


class CopyVerdict(_Named):
    """Why a copy of a rescheduled message may not run (see :class:`Copy`)."""

    #: A copy of an earlier reschedule: a later copy of the message runs.
    STALE = "stale"
    #: The other copy of its reschedule arrived first.
    LOST = "lost"
    #: A copy of a run that succeeded, with no more retries than it: a
    #: broker published or delivered it twice.  (A failed run, or a
    #: retired copy, never finishes its message.)
    DONE = "done"


class ReplaceStatus(_Named):
    """What :meth:`LockBackend.replace` did."""

    #: The key was free: the send holds it now.
    ACQUIRED = "acquired"
    #: The send already held it (a publish retry).
    REENTERED = "reentered"
    #: ``holder`` was superseded: the send is the current holder.
    REPLACED = "replaced"
    #: ``holder`` has started and the lock type keeps it: refused.
    REFUSED = "refused"


class CurrentStatus(enum.IntEnum):
    """What :meth:`LockBackend.current` found of a message.  The values
    are current.lua's reply codes, so that code written against the
    numbers ``current`` answered before still compares equal.
    """

    #: A newer send superseded it: ``other`` is that send.
    SUPERSEDED = -2
    #: A re-enqueued copy that may not run: ``other`` is the verdict
    #: (a :class:`CopyVerdict`'s text); nothing was taken.
    MAY_NOT_RUN = 3
    #: A delivery: the message is current (and now started).  A
    #: re-enqueue: it took the free key afresh (``other`` is itself).
    CURRENT = 1
    #: A re-enqueue re-entered its slot (``other`` is itself).
    REENTERED = 2
    #: A re-enqueue whose slot lapsed: ``other`` holds the key.
    LAPSED = 0


class CurrentCheck(NamedTuple):
    """The outcome of :meth:`LockBackend.current`.

    Attributes:
      status(CurrentStatus): What was found.
      other(str): The message it names (see :class:`CurrentStatus`), or
        None.
    """

    status: CurrentStatus
    other: Optional[str] = None


class Acquisition(NamedTuple):
    """The outcome of :meth:`LockBackend.acquire`.

    Attributes:
      acquired(bool): True when the owner holds the lock now.
      reentered(bool): True when the owner already held it.
      holder(str): On a conflict, the owner of one of the holders.
      fence(int): A fencing token that grows with every new holder of
        the key.
      provisional(bool): True when the slot holds for the provisional
        window only: :meth:`LockBackend.confirm` it once the message is
        published.
      refused(CopyVerdict): When the acquisition was asked for a
        :class:`Copy` that may not run: why.  Nothing was taken.
    """

    acquired: bool
    reentered: bool = False
    holder: Optional[str] = None
    fence: int = 0
    provisional: bool = False
    refused: Optional[CopyVerdict] = None


class Copy(NamedTuple):
    """One copy of a message that may exist several times over: the
    original, or the delayed or handed-over copy of a reschedule, each
    also retried, redelivered and moved out of the delay queue under
    the same message id.  See ``docs/reliability.md``, "The hand-off
    model".

    Attributes:
      key(str): The run lock the message waits for, or waited for.
      message_id(str): The logical message.
      attempt(int): How many times it was rescheduled: 0 for the
        original.
      via(str): ``"delay"`` or ``"handoff"`` for the two copies of a
        reschedule, ``""`` for the original.
      lock_args(str): The lock args JSON a run lock taken for this copy
        records (``record_lock_args``); None records none.
      retries(int): Its Retries count: a retry of a copy whose run
        ended has more retries than it, a duplicate of it no more.
    """

    key: str
    message_id: str
    attempt: int = 0
    via: str = ""
    lock_args: Optional[str] = None
    retries: int = 0


class Start(NamedTuple):
    """The outcome of :meth:`LockBackend.start`.

    Attributes:
      acquisition(Acquisition): Of the run lock; ``refused`` names why
        this copy may not run (a :class:`CopyVerdict`), and then
        nothing was taken.
      queue_released(bool): The enqueue lock was held, and is released.
      in_line(bool): The lock is held (or reserved for another waiter)
        and this copy's message is still in line for it: nothing was
        written; the copy only has to come back later.
      promoted(bytes): The slot was free and an older waiter was in
        line: it was handed to that waiter (and reserved for it), whose
        encoded message the caller enqueues at once.
      duplicate_of(str): With ``refused`` DONE: the run lock owner of
        the run that this copy duplicates.
      free_in(int): With ``in_line``: in how many milliseconds the
        key's last holder or reservation runs out unless renewed.
    """

    acquisition: Acquisition
    queue_released: bool = False
    in_line: bool = False
    promoted: Optional[bytes] = None
    duplicate_of: Optional[str] = None
    free_in: Optional[int] = None


class Release(NamedTuple):
    """The outcome of :meth:`LockBackend.release`.

    Attributes:
      held(bool): False when the owner no longer held the lock: it had
        expired, or an operator had removed it.
      promoted(bytes): The encoded message of the longest waiter, taken
        off the key's waiting list to be enqueued at once.
    """

    held: bool
    promoted: Optional[bytes] = None


@dataclass(frozen=True)
class EnqueueRecord:
    """What an enqueue lock records about its holder, for operators and
    the reaper.

    Attributes:
      taken_at(int): When the slot was taken, in Unix milliseconds.
      provisional_until(int): While the slot waits for its message's
        publish to be confirmed, the Unix milliseconds when it lapses
        unless confirmed; 0 once confirmed.
      where(str): Where the message was last published (for the Redis
        broker ``namespace\tqueue\tredis_message_id``), or "".
      before(str): Where it was published before that, or "": during a
        move between queues the message is at one of the two.
    """

    taken_at: int
    provisional_until: int = 0
    where: str = ""
    before: str = ""

    def encode(self) -> str:
        """The text the backend stores."""
        return f"{self.taken_at}|{self.provisional_until}|{self.where}\n{self.before}"

    @classmethod
    def decode(cls, text: str) -> Optional["EnqueueRecord"]:
        """Parse stored text; None when it is not a record."""
        try:
            taken, provisional, places = text.split("|", 2)
            where, _, before = places.partition("\n")
            return cls(int(taken), int(provisional), where, before)
        except ValueError:
            return None

    @property
    def queue(self) -> str:
        """The queue ``where`` names, without a delay queue's ``.DQ``;
        "" if none.
        """
        return Place.queue_in(self.where)


def _canonical_queue(queue: str) -> str:
    """``queue`` without a delay queue's ``.DQ``."""
    return queue[:-3] if queue.endswith(".DQ") else queue


@dataclass(frozen=True)
class Place:
    """Where a message was published, as an :class:`EnqueueRecord`
    writes it: ``namespace\tqueue\tredis_message_id`` (namespace and id
    empty on brokers other than Redis).
    """

    namespace: str
    queue: str
    redis_id: str

    @classmethod
    def parse(cls, where: str) -> Optional["Place"]:
        """The place in a record's ``where``; None when it names none
        that can be looked up (another broker, or nothing recorded).
        """
        parts = where.split("\t")
        if len(parts) != 3 or not parts[0] or not parts[2]:
            return None
        return cls(*parts)

    @staticmethod
    def queue_in(where: str) -> str:
        """The queue a ``where`` names, on any broker, without a delay
        queue's ``.DQ``; "" if none.
        """
        parts = where.split("\t")
        return _canonical_queue(parts[1]) if len(parts) == 3 else ""

    @property
    def canonical_queue(self) -> str:
        return _canonical_queue(self.queue)


@dataclass(frozen=True)
class Replacement:
    """The outcome of :meth:`LockBackend.replace`.

    Attributes:
      status(ReplaceStatus): What the replace did.
      holder(str): The message superseded, or the one that refused.
      delay(int): Under debounce, how long from now the message is due,
        in milliseconds; 0 otherwise.
      fence(int): The key's fencing token.
    """

    status: ReplaceStatus
    holder: Optional[str] = None
    delay: int = 0
    fence: int = 0


@dataclass(frozen=True)
class LockInfo:
    """What an operator sees of one lock key.

    Attributes:
      key(str): The full key.
      lock(str): The lock type that took it.
      holders(dict[str, int]): owner -> deadline in Unix milliseconds.
      lock_args(str): JSON of the lock args, when they were recorded.
      fence(int): The last fencing token handed out.
      current(str): Under ``on_conflict="replace"``, the message that
        runs next: the newest send.
      superseded(int): How many messages this key's sends superseded
        since it was taken.
      records(dict[str, EnqueueRecord]): owner -> its enqueue record,
        for the holders that have one.
    """

    key: str
    lock: Optional[str]
    holders: dict[str, int]
    lock_args: Optional[str] = None
    fence: int = 0
    current: Optional[str] = None
    superseded: int = 0
    records: dict[str, EnqueueRecord] = field(default_factory=dict)


#: How many messages of one producer, made in one millisecond, keep
#: their order among a key's waiters; a zset score stays exact (under
#: 2**53) with timestamps in milliseconds times this.
SENDS_PER_MS = 1000


#: How long the record of a rescheduled message outlives its run and
#: its last expected copy, in milliseconds: the window in which a copy
#: that a broker published or delivered twice is still known as a
#: duplicate (``_claim.lua`` holds the same figure).
DUPLICATE_WINDOW = 600_000

#: How long, in milliseconds, a slot handed to a waiter stays reserved
#: for its message when the caller names no other bound.
DEFAULT_RESERVE = 10_000


class Releasing(NamedTuple):
    """One run lock to release with :meth:`LockBackend.release_many`.

    Attributes:
      key(str): The lock key.
      owner(str): Its holder.
      succeeded(bool): The holder's run succeeded: it finishes its
        message (see :meth:`LockBackend.release`).
      reserve(int): How long the slot handed to a waiter stays
        reserved for it, in milliseconds.
    """

    key: str
    owner: str
    succeeded: bool = False
    reserve: int = DEFAULT_RESERVE


@dataclass(frozen=True)
class Waiter:
    """A message waiting for a run lock, to be handed the key when a
    holder releases it (see :meth:`LockBackend.wait`).

    Attributes:
      message_id(str): The waiting message.
      order(int): Its place in line, the lowest first: the Unix
        millisecond its message was made times :data:`SENDS_PER_MS`,
        plus its place among its producer's sends of that millisecond.
    """

    message_id: str
    order: int

    @property
    def sent_at(self) -> int:
        """When the message was first sent, in Unix milliseconds."""
        return self.order // SENDS_PER_MS


class LockReads(abc.ABC):
    """What operators read of a backend: no verb here changes a lock.
    :class:`~dramatiq_unique.ops.admin.LockAdmin` and the dashboard read
    through these; the middleware never does.
    """

    @abc.abstractmethod
    def inspect(self, key: str) -> Optional[LockInfo]:
        """Describe ``key``, or None when nobody holds it."""
        raise NotImplementedError  # pragma: no cover

    @abc.abstractmethod
    def scan(self, pattern: str) -> Iterator[str]:
        """Iterate over the held keys matching a glob ``pattern``."""
        raise NotImplementedError  # pragma: no cover

    def waiters(self, key: str) -> list[Waiter]:
        """The messages waiting for run lock ``key``, first in line
        first; for operators.  A backend without waiting lists has none.
        """
        return []

    def describe(self) -> str:
        """A short description for error messages, e.g. a URL."""
        return type(self).__name__


class LockBackend(LockReads):
    """ABC for lock backends.  Durations are in milliseconds.

    The verbs are grouped by who calls them: the hot path (every job
    makes these), sending with the publish (an optional capability),
    the reschedule protocol, newest wins (``on_conflict="replace"``),
    and operators' writes.  Operators' reads are :class:`LockReads`.
    """

    #: True when :meth:`release_many` sends its releases in one round
    #: trip: the worker then releases run locks in the background.
    batches_releases: bool = False

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
            rescheduled: nothing is taken when it may not run.
        """
        raise NotImplementedError  # pragma: no cover

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
        """Claim the delivered ``copy`` (see :meth:`claim`), take a slot
        of the run lock ``key`` for ``owner``, and release the enqueue
        lock ``queue_key`` of the message once the slot is taken: one
        round trip for everything a delivery takes before it runs.

        A slot reserved for another message counts as held.  A free
        slot goes to the oldest waiter in line instead, when one was
        sent before ``copy`` (``order``, see :meth:`wait`; None: after
        every waiter): it is reserved for it for ``reserve`` ms and its
        message returned in :attr:`Start.promoted`.  A copy whose
        message is still in line when the slot is not its to take
        changes nothing (:attr:`Start.in_line`).
        """
        raise NotImplementedError  # pragma: no cover

    @abc.abstractmethod
    def release(
        self, key: str, owner: str, *, hand_over: bool = True, succeeded: bool = False, reserve: int = DEFAULT_RESERVE
    ) -> Release:
        """Remove ``owner`` from ``key``, and hand the freed slot to the
        longest waiter of ``key``, if any (see :meth:`wait`), reserved
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
        raise NotImplementedError  # pragma: no cover

    def release_many(self, locks: Sequence[tuple[Any, ...]]) -> list[Union[Release, Exception]]:
        """Release each ``(key, owner)`` (or :class:`Releasing`) and hand
        its slot over, as :meth:`release` does, in as few round trips as
        the backend can.

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

    def release_and_start(
        self,
        releases: Sequence[tuple[Any, ...]],
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
    ) -> tuple[list[Union[Release, Exception]], Union[Start, Exception]]:
        """Release each of ``releases`` as :meth:`release_many` does,
        then :meth:`start` ``key`` for ``owner``: in one round trip where
        the backend batches releases.

        Returns:
          tuple: the outcome of each release, and the :class:`Start`, or
          the exception the start raised.
        """
        released = self.release_many(releases)
        try:
            started = self.start(
                key, owner, ttl=ttl, limit=limit, lock=lock, copy=copy, queue_key=queue_key, order=order,
                reserve=reserve,
            )
            return released, started
        except Exception as e:
            return released, e

    @abc.abstractmethod
    def extend(self, locks: Sequence[tuple[str, str]], ttl: int) -> list[bool]:
        """Move the deadline of each ``(key, owner)`` to ``ttl`` from
        now, in one round trip.  An owner whose slot lapsed or was taken
        is not extended.

        Returns:
          list[bool]: per lock, whether it is still held.
        """
        raise NotImplementedError  # pragma: no cover

    @abc.abstractmethod
    def confirm(self, locks: Sequence[tuple[str, str, int]]) -> list[bool]:
        """Give each provisional ``(key, owner, ttl)`` slot its full
        lifetime: a deadline of at least ``ttl`` from now, in one round
        trip.  A slot released meanwhile, or lapsed, is never revived.

        Returns:
          list[bool]: per lock, whether it is still held.
        """
        raise NotImplementedError  # pragma: no cover

    # Sending with the publish (optional) -----------------------------

    @property
    def dispatch_client(self) -> Optional[Any]:
        """The standalone Redis client on which :meth:`acquire_and_dispatch`
        runs the broker's own script, or None when this backend cannot
        take a lock and publish in one call (the default): the send
        fast path (:mod:`dramatiq_unique.send.fastpath`) is then off.
        """
        return None

    def acquire_and_dispatch(
        self,
        key: str,
        owner: str,
        *,
        ttl: int,
        limit: int,
        lock: str,
        lock_args: Optional[str],
        where: str,
        dispatch: str,
        namespace: str,
        arguments: Sequence[Any],
    ) -> Acquisition:
        """Acquire ``key`` as :meth:`acquire` does, confirmed at once and
        recording ``where``, and only when that succeeds run the Redis
        broker's ``dispatch`` script source with ``arguments`` under
        ``namespace``, in one round trip.  Only where
        :attr:`dispatch_client` is not None.

        Raises:
          NotImplementedError: this backend cannot (the default).
        """
        raise NotImplementedError(f"{type(self).__name__} cannot take a lock and publish in one call.")

    # The reschedule protocol -----------------------------------------

    @abc.abstractmethod
    def wait(self, copy: Copy, message: bytes, *, order: int, ttl: int) -> int:
        """Register the message of ``copy`` as waiting for ``copy.key``,
        as reschedule ``copy.attempt``, with ``message`` the encoded copy
        to hand the key to.  Waiters are promoted in ``order``, lowest
        first.  The caller also enqueues a delayed copy: whichever of the
        two arrives first wins the attempt.

        Returns:
          int: How many waiters are ahead of it in line (0 when a wait
          sent again after its lost reply changed nothing).

        Parameters:
          ttl(int): How long the records live, in milliseconds.
        """
        raise NotImplementedError  # pragma: no cover

    @abc.abstractmethod
    def claim(self, copy: Copy) -> bool:
        """Settle that ``copy`` arrived, without taking a lock.

        Returns:
          bool: True when this copy may run: the first of its attempt to
          arrive (it withdraws the message's waiter), a retry or
          redelivery of that first copy, or a copy with no record.
          False for a copy of an earlier attempt, or the second copy of
          its attempt.
        """
        raise NotImplementedError  # pragma: no cover

    @abc.abstractmethod
    def withdraw(self, copy: Copy) -> None:
        """Take back the wait that ``copy`` registered (as attempt
        ``copy.attempt + 1``) when its delayed copy was never enqueued:
        ``copy`` is its message's winner again and no hand-off happens.
        """
        raise NotImplementedError  # pragma: no cover

    # Newest wins: on_conflict="replace" and debounce -----------------

    @abc.abstractmethod
    def replace(
        self,
        key: str,
        owner: str,
        *,
        ttl: int,
        lock: str = "",
        lock_args: Optional[str] = None,
        keep_started: bool = False,
        debounce: int = 0,
        debounce_max: int = 0,
        superseded_ttl: int,
        where: str = "",
    ) -> Replacement:
        """Make ``owner`` the current holder of the enqueue lock ``key``
        (one slot), superseding the message that held it, in one round
        trip.  The superseded id is recorded for ``superseded_ttl`` ms,
        so that every later copy of it is skipped (:meth:`current`).

        A holder that has started keeps its own slot until it releases
        it; with ``keep_started`` the send is refused instead.

        Parameters:
          debounce(int): When > 0, the message is due ``debounce`` ms
            from now, but never later than ``debounce_max`` (when > 0)
            after the first send of the burst, which the key records.
          where(str): Where the message is being published, kept in the
            owner's :class:`EnqueueRecord` (with when it was taken).
        """
        raise NotImplementedError  # pragma: no cover

    @abc.abstractmethod
    def current(
        self,
        key: str,
        owner: str,
        *,
        reenter: bool = False,
        ttl: int = 0,
        lock: str = "",
        copy: Optional[Copy] = None,
        where: Optional[str] = None,
    ) -> CurrentCheck:
        """Whether message ``owner`` is still current under replace.

        Without ``reenter`` (a delivery), a current message is marked as
        started; with it (a re-enqueue), a current message re-enters its
        slot like :meth:`acquire`, or takes the free key again, unless
        it is a ``copy`` that may not run (as :meth:`acquire` checks);
        ``where`` then updates the owner's :class:`EnqueueRecord`.

        Returns:
          CurrentCheck: what was found, and the message it names (see
          :class:`CurrentStatus`).
        """
        raise NotImplementedError  # pragma: no cover

    @abc.abstractmethod
    def unreplace(self, key: str, owner: str) -> Optional[str]:
        """Undo the :meth:`replace` of ``owner``, whose message was never
        published: the message it superseded is current again, with
        ``owner``'s deadline.  ``owner``'s slot is left to :meth:`release`.

        Returns:
          str: The message made current again, or None.
        """
        raise NotImplementedError  # pragma: no cover

    # Operators' writes -----------------------------------------------

    @abc.abstractmethod
    def reap(self, key: str, owner: str, record: EnqueueRecord) -> bool:
        """Release ``owner``'s slot of ``key`` if its enqueue record is
        still ``record``: a reaper checked that record's message and
        found it nowhere.

        Returns:
          bool: True when a live slot was released.
        """
        raise NotImplementedError  # pragma: no cover

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Drop ``key`` and all its holders: an operator's override."""
        raise NotImplementedError  # pragma: no cover
