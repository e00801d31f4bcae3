"""The lock backend interface: a core every backend has, and named
capabilities that a backend has or lacks.

The core (:class:`LockBackend`, with the operators' reads of
:class:`LockReads`) is what every lock type needs.  A capability is an
abstract class deriving from it, which a backend inherits when it can do
what the capability says; callers check it with ``isinstance``, never by
a backend's class name or ``hasattr``:

* :class:`Reschedules`: the reschedule protocol (``join_line``, ``claim``),
  for ``on_conflict="reschedule"``;
* :class:`NewestWins`: ``replace``, ``current`` and ``unreplace``, for
  ``on_conflict="replace"`` and ``debounce``;
* :class:`SendsWithPublish`: take an enqueue lock and publish to the
  Redis broker in one call (the send fast path);
* :class:`BatchedReleases`: releases, and the start they ride with, in
  one round trip (the worker then releases in the background);
* :class:`RenewsNatively`: lease renewals from a native OS thread under
  gevent's monkey-patching.

The middleware refuses, at set-up, an actor whose options need a
capability its backend lacks (:class:`MissingCapability`).

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
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator, NamedTuple, Optional, Protocol, Sequence, TypeVar, Union

from ..errors import ConfigurationError
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
        raise NotImplementedError  # pragma: no cover

    @abc.abstractmethod
    def scan(self, pattern: str) -> Iterator[str]:
        """Iterate over the held keys matching ``pattern``, a glob read
        as :func:`glob_pattern` says, each key once.  A backend may also
        yield the keys it keeps beside a lock (waiters, records), which
        share the lock key as their prefix: callers that want locks
        only match the phase at the end (``*:run``, ``*:queue``).
        """
        raise NotImplementedError  # pragma: no cover

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
        raise NotImplementedError  # pragma: no cover

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
        raise NotImplementedError  # pragma: no cover

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

    @abc.abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Drop every key that starts with ``prefix`` (a plain string,
        not a glob): locks, and what the backend keeps beside them
        (waiters, message records, superseded records).  For tests and
        for operators clearing an application's keys.

        Returns:
          int: How many keys were dropped (as the backend counts them).
        """
        raise NotImplementedError  # pragma: no cover


# Capabilities ----------------------------------------------------------


class MissingCapability(ConfigurationError):
    """An actor's options need a capability that the lock backend lacks.

    Attributes:
      backend(str): The backend, as it describes itself.
      capability(str): The capability's class name, e.g. ``NewestWins``.
    """

    def __init__(self, message: str, *, backend: str, capability: str) -> None:
        super().__init__(message)
        self.backend = backend
        self.capability = capability


C = TypeVar("C", bound="Capability")


class Capability(LockBackend):
    """The base of every capability: what a backend inherits to say it
    can do more than the core.
    """

    #: What error messages call the capability.
    capability: ClassVar[str] = "a capability"

    @classmethod
    def require(cls: type[C], backend: LockBackend, *, feature: str) -> C:
        """``backend``, when it has this capability.

        Parameters:
          feature(str): What needs it, for the error, e.g.
            ``"on_conflict='replace' (actor 'sync')"``.

        Raises:
          MissingCapability: naming the backend, the capability and
            ``feature``.
        """
        if isinstance(backend, cls):
            return backend
        raise MissingCapability(
            f"{feature} needs a lock backend with {cls.capability} ({cls.__name__}), "
            f"and {backend.describe()} has none: use a backend that has it, or another option.",
            backend=backend.describe(),
            capability=cls.__name__,
        )


class Reschedules(Capability):
    """The reschedule protocol, for ``on_conflict="reschedule"``: a
    message that meets a held run lock waits for it (:meth:`join_line`) and
    is enqueued again twice, delayed and handed over, and the first of
    the two copies to arrive runs (:meth:`claim`, and :meth:`~LockBackend.start`
    with its ``copy``).  See ``docs/reliability.md``, "The hand-off model".
    """

    capability = "the reschedule protocol"

    @abc.abstractmethod
    def join_line(self, copy: Copy, message: bytes, *, order: int, ttl: int) -> int:
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


class NewestWins(Capability):
    """Newest wins: ``on_conflict="replace"`` and ``debounce``, where a
    send supersedes the message that holds the enqueue lock.
    """

    capability = "newest wins (replace, current, unreplace)"

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
        slot like :meth:`~LockBackend.acquire`, or takes the free key
        again, unless it is a ``copy`` that may not run (as
        :meth:`~LockBackend.acquire` checks); ``where`` then updates the
        owner's :class:`EnqueueRecord`.

        Returns:
          CurrentCheck: what was found, and the message it names (see
          :class:`CurrentStatus`).
        """
        raise NotImplementedError  # pragma: no cover

    @abc.abstractmethod
    def unreplace(self, key: str, owner: str) -> Optional[str]:
        """Undo the :meth:`replace` of ``owner``, whose message was never
        published: the message it superseded is current again, with
        ``owner``'s deadline.  ``owner``'s slot is left to
        :meth:`~LockBackend.release`.

        Returns:
          str: The message made current again, or None.
        """
        raise NotImplementedError  # pragma: no cover


class DispatchFailed(Exception):
    """The broker's own enqueue failed inside
    :meth:`SendsWithPublish.acquire_and_dispatch`: nothing was enqueued,
    and the lock the call took was dropped.  A backend raises a subclass
    that is also its client's error (a ``redis.ResponseError`` on
    Redis), as the broker's own enqueue would have raised.
    """


class SendsWithPublish(Capability):
    """Sending with the publish: take an enqueue lock and run the Redis
    broker's own enqueue script in one call, when the locks live in the
    broker's Redis (the send fast path, :mod:`dramatiq_unique.send.fastpath`).
    """

    capability = "sending with the publish"

    @property
    @abc.abstractmethod
    def dispatch_client(self) -> Optional[Any]:
        """The standalone Redis client on which :meth:`acquire_and_dispatch`
        runs the broker's own script, or None when this instance cannot
        (a Cluster): the send fast path is then off.
        """
        raise NotImplementedError  # pragma: no cover

    @abc.abstractmethod
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
        """Acquire ``key`` as :meth:`~LockBackend.acquire` does,
        confirmed at once and recording ``where``, and only when that
        succeeds run the Redis broker's ``dispatch`` script source with
        ``arguments`` under ``namespace``, in one round trip.  Only where
        :attr:`dispatch_client` is not None.

        Raises:
          DispatchFailed: ``dispatch`` failed; nothing is locked by
            this call.
        """
        raise NotImplementedError  # pragma: no cover


class BatchedReleases(Capability):
    """Batched releases: :meth:`~LockBackend.release_many` sends its
    releases in one round trip, and :meth:`release_and_start` sends them
    with the next start.  The worker then releases run locks off the
    worker thread (:class:`~dramatiq_unique.worker.releaser.Releaser`).
    """

    capability = "batched releases"

    #: Whether this instance batches: False where it cannot (a Redis
    #: Cluster), which then releases as the core does.
    batches_releases: bool = True

    @abc.abstractmethod
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
        """Release each of ``releases`` as
        :meth:`~LockBackend.release_many` does, then
        :meth:`~LockBackend.start` ``key`` for ``owner``, in one round
        trip (:func:`release_then_start` does it in two).

        Returns:
          tuple: the outcome of each release, and the :class:`Start`, or
          the exception the start raised.
        """
        raise NotImplementedError  # pragma: no cover


def release_then_start(
    backend: LockBackend,
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
    """:meth:`BatchedReleases.release_and_start` in two calls: the
    releases, then the start, on any backend.
    """
    released = backend.release_many(releases)
    try:
        started = backend.start(
            key, owner, ttl=ttl, limit=limit, lock=lock, copy=copy, queue_key=queue_key, order=order, reserve=reserve
        )
        return released, started
    except Exception as e:
        return released, e


class NativeExtender(Protocol):
    """:meth:`LockBackend.extend` on a connection of its own, for a
    native OS thread under gevent's monkey-patching: made with the
    original (unpatched) socket module (``compat.original``), so that no
    greenlet-patched socket or pool lock is touched from another OS
    thread.  Used by one thread at a time.
    """

    def __call__(self, locks: Sequence[tuple[str, str]], ttl: int, *, timeout: float) -> list[bool]:
        """Extend each ``(key, owner)`` to ``ttl`` ms from now, as
        :meth:`LockBackend.extend` does, waiting at most ``timeout`` ms
        for the whole exchange (the caller's lease deadline).

        Raises:
          TimeoutError: no answer in time (or ``timeout`` <= 0); the
            connection is closed.
          OSError: the connection failed; it is closed.
          RuntimeError: the backend refused the renewal.
        """
        ...  # pragma: no cover

    def close(self) -> None:
        """Close the connection; the next call opens a new one."""
        ...  # pragma: no cover


class RenewsNatively(Capability):
    """Renewal from a native thread: under gevent the lease keeper runs
    on a native OS thread, so that leases renew while an actor holds the
    hub in a C call or a CPU loop, and renews through
    :meth:`native_extender`.  Without it, leases renew on a greenlet.

    A backend implements it with a connection that it drives from the
    native thread without gevent's patched modules: the Redis backend
    speaks RESP on an unpatched socket; a PostgreSQL backend would use
    a libpq-level connection of its own (psycopg's ``pgconn``), waiting
    on its socket with the original ``select``, and run its extend
    statement there.
    """

    capability = "renewal from a native thread"

    @abc.abstractmethod
    def native_extender(self) -> Optional[NativeExtender]:
        """A new :class:`NativeExtender` on a connection of its own, or
        None when this instance cannot make one (TLS, Sentinel, a
        Cluster, a client of someone else's making): the caller then
        renews on a greenlet.  Called once per process, on the hub.
        """
        raise NotImplementedError  # pragma: no cover


#: Every capability, in the order the docs list them.
CAPABILITIES: tuple[type[Capability], ...] = (
    Reschedules,
    NewestWins,
    SendsWithPublish,
    BatchedReleases,
    RenewsNatively,
)


def capabilities(backend: LockBackend) -> list[str]:
    """The names of the capabilities ``backend`` has, e.g. for a log."""
    return [kind.__name__ for kind in CAPABILITIES if isinstance(backend, kind)]
