"""The records the lock backends' verbs take and return: outcomes as
named tuples (immutable, at a third of a frozen dataclass's cost to
build: every job makes several), their statuses as enums, and the
figures the backends share.  Pure declarations: no verb runs here.
"""

from __future__ import annotations

import enum
from types import MappingProxyType
from typing import Mapping, NamedTuple, Optional

from ..model.wire import EnqueueRecord


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


class Replacement(NamedTuple):
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


class LockInfo(NamedTuple):
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
    records: Mapping[str, EnqueueRecord] = MappingProxyType({})


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


class ReplaceArgs(NamedTuple):
    """The arguments of :meth:`~.capabilities.NewestWins.replace`, in order."""

    key: str
    owner: str
    ttl: int
    lock: str
    lock_args: Optional[str]
    keep_started: bool
    debounce: int
    debounce_max: int
    superseded_ttl: int
    where: str


class TakeArgs(NamedTuple):
    """The keywords of :meth:`~.base.LockBackend.acquire` that say what
    to take, with its defaults: what the backends' take reads.
    """

    ttl: int
    limit: int = 1
    lock: str = ""
    lock_args: Optional[str] = None
    provisional: int = 0
    where: Optional[str] = None


class StartArgs(NamedTuple):
    """The keywords of :meth:`~.base.LockBackend.start`, with its
    defaults: what the backends' start reads.
    """

    ttl: int
    limit: int
    lock: str
    copy: Copy
    queue_key: Optional[str] = None
    order: Optional[int] = None
    reserve: int = DEFAULT_RESERVE


class CurrentArgs(NamedTuple):
    """The arguments of :meth:`~.capabilities.NewestWins.current`, in order."""

    key: str
    owner: str
    reenter: bool
    ttl: int
    lock: str
    copy: Optional[Copy]
    where: Optional[str]


class Waiter(NamedTuple):
    """A message waiting for a run lock, to be handed the key when a
    holder releases it (see :meth:`Reschedules.join_line`).

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


class HeldSlot(NamedTuple):
    """One holder of a listed lock (see :class:`ListedLock`).

    Attributes:
      owner(str): The owner string, as the backend stores it.
      deadline(int): When the slot expires, in Unix milliseconds.
      record(EnqueueRecord): Its record, when the lock keeps one.
    """

    owner: str
    deadline: int
    record: Optional[EnqueueRecord]


class ListedLock(NamedTuple):
    """One live lock key, as :class:`~.base.PrefixLocks` lists it.

    Attributes:
      key(str): The full key.
      actor(str): The actor part of the key (``@any`` for locks taken
        with ``unique_across_actors``).
      digest(str): The 32 hex characters inside the braces.
      phase(str): ``queue`` for an enqueue lock, ``run`` for a run lock.
      lock(str): The lock type that took it.
      lock_args(str): JSON of the lock args, when they were recorded.
      holders(tuple[HeldSlot, ...]): Its holders, soonest deadline first.
      info(LockInfo): All that :meth:`~.base.LockReads.inspect` found.
    """

    key: str
    actor: str
    digest: str
    phase: str
    lock: Optional[str]
    lock_args: Optional[str]
    holders: tuple[HeldSlot, ...]
    info: LockInfo
