"""The records the backends' verbs take and return, their statuses, and
shared figures.  Named tuples: immutable at a third of a frozen
dataclass's cost to build, and every job makes several.
"""

from __future__ import annotations

import enum
from types import MappingProxyType
from typing import Mapping, NamedTuple, Optional

from ..model.wire import EnqueueRecord


class _Named(str, enum.Enum):
    """An outcome equal to its text and printed as it, like the strings it replaced."""

    def __str__(self) -> str:
        return str(self.value)


class CopyVerdict(_Named):
    """Why a copy of a rescheduled message may not run (see :class:`Copy`)."""

    #: A copy of an earlier reschedule: a later copy of the message runs.
    STALE = "stale"
    #: The other copy of its reschedule arrived first.
    LOST = "lost"
    #: A copy of a succeeded run, with no more retries: a duplicate publish or delivery.
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
    """What :meth:`LockBackend.current` found of a message.  The values are
    current.lua's codes, so code written against the old numbers still works.
    """

    #: A newer send superseded it: ``other`` is that send.
    SUPERSEDED = -2
    #: A re-enqueued copy that may not run: ``other`` is the verdict's text.
    MAY_NOT_RUN = 3
    #: A delivery: current (now started).  A re-enqueue: took the free key (``other``: itself).
    CURRENT = 1
    #: A re-enqueue re-entered its slot (``other`` is itself).
    REENTERED = 2
    #: A re-enqueue whose slot lapsed: ``other`` holds the key.
    LAPSED = 0


class CurrentCheck(NamedTuple):
    """The outcome of :meth:`LockBackend.current`: the status, and the message it names (``other``) or None."""

    status: CurrentStatus
    other: Optional[str] = None


class Acquisition(NamedTuple):
    """The outcome of :meth:`LockBackend.acquire`.

    Attributes:
      holder(str): On a conflict, the owner of one of the holders.
      fence(int): A fencing token that grows with every new holder.
      provisional(bool): The slot holds for the provisional window only,
        until :meth:`LockBackend.confirm` (once the message is published).
      refused(CopyVerdict): Why the :class:`Copy` may not run; nothing was taken.
    """

    acquired: bool
    reentered: bool = False
    holder: Optional[str] = None
    fence: int = 0
    provisional: bool = False
    refused: Optional[CopyVerdict] = None


class Copy(NamedTuple):
    """One copy of a message that exists several times over under one id: the
    original, or a reschedule's delayed or handed-over copy, each maybe
    retried or redelivered.  See ``docs/reliability.md``, "The hand-off model".

    Attributes:
      key(str): The run lock the message waits or waited for.
      message_id(str): The logical message.
      attempt(int): How many times it was rescheduled (0: the original).
      via(str): ``"delay"``, ``"handoff"``, or ``""`` for the original.
      lock_args(str): The lock args JSON its run lock records, or None.
      retries(int): Its Retries count: more for a retry of a copy whose run
        ended, no more for a duplicate.
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
      acquisition(Acquisition): Of the run lock (``refused``: why this copy may not run).
      queue_released(bool): The enqueue lock was held, and is released.
      in_line(bool): Held or reserved, and this copy's message still in line:
        nothing was written; the copy comes back later.
      promoted(bytes): The free slot went (reserved) to an older waiter,
        whose encoded message the caller enqueues at once.
      duplicate_of(str): With ``refused`` DONE: the owner of the run duplicated.
      free_in(int): With ``in_line``: ms until the last holder or reservation runs out.
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
      held(bool): False when the owner no longer held it (expired, or removed).
      promoted(bytes): The longest waiter's encoded message, to enqueue at once.
    """

    held: bool
    promoted: Optional[bytes] = None


#: How many messages of one producer in one millisecond keep their order
#: among a key's waiters; a zset score of ms times this stays under 2**53.
SENDS_PER_MS = 1000

#: How long, in ms, a rescheduled message's record outlives its run and
#: last expected copy: the window in which a duplicate publish or delivery
#: is known as one (``_claim.lua`` holds the same figure).
DUPLICATE_WINDOW = 600_000

#: How long, in ms, a slot handed to a waiter stays reserved by default.
DEFAULT_RESERVE = 10_000


class Replacement(NamedTuple):
    """The outcome of :meth:`LockBackend.replace`.

    Attributes:
      holder(str): The message superseded, or the one that refused.
      delay(int): Under debounce, in how many ms the message is due; else 0.
    """

    status: ReplaceStatus
    holder: Optional[str] = None
    delay: int = 0
    fence: int = 0


class LockInfo(NamedTuple):
    """What an operator sees of one lock key.

    Attributes:
      holders(dict[str, int]): owner -> deadline in Unix milliseconds.
      lock_args(str): JSON of the lock args, when they were recorded.
      fence(int): The last fencing token handed out.
      current(str): Under ``on_conflict="replace"``, the newest send.
      superseded(int): How many messages its sends superseded since taken.
      records(dict[str, EnqueueRecord]): owner -> its enqueue record.
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
    """One run lock to release with :meth:`LockBackend.release_many`; ``succeeded`` and ``reserve`` as there."""

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
    """The keywords of :meth:`~.base.LockBackend.acquire` that say what to take."""

    ttl: int
    limit: int = 1
    lock: str = ""
    lock_args: Optional[str] = None
    provisional: int = 0
    where: Optional[str] = None


class StartArgs(NamedTuple):
    """The keywords of :meth:`~.base.LockBackend.start`, with its defaults."""

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
    """A message waiting for a run lock (see :meth:`Reschedules.join_line`).

    Attributes:
      order(int): Its place in line, lowest first: the Unix ms it was made
        times :data:`SENDS_PER_MS`, plus its rank among its producer's sends.
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
      deadline(int): When the slot expires, in Unix milliseconds.
      record(EnqueueRecord): Its record, when the lock keeps one.
    """

    owner: str
    deadline: int
    record: Optional[EnqueueRecord]


class ListedLock(NamedTuple):
    """One live lock key, as :class:`~.base.PrefixLocks` lists it.

    Attributes:
      actor(str): The key's actor part (``@any`` under ``unique_across_actors``).
      digest(str): The 32 hex characters inside the braces.
      phase(str): ``queue`` for an enqueue lock, ``run`` for a run lock.
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
