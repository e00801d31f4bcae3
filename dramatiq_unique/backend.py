"""The lock backend interface.

A lock is a set of holders under one key.  Each holder is an owner
string with its own deadline, so ``limit`` holders may share a key and
a dead holder frees only its own slot.  Every verb checks the owner,
and every deadline is enforced by the backend's own clock.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Union


@dataclass(frozen=True)
class Acquisition:
    """The outcome of :meth:`LockBackend.acquire`.

    Attributes:
      acquired(bool): True when the owner holds the lock now.
      reentered(bool): True when the owner already held it.
      holder(str): On a conflict, the owner of one of the holders.
      fence(int): A fencing token that grows with every new holder of
        the key.
    """

    acquired: bool
    reentered: bool = False
    holder: Optional[str] = None
    fence: int = 0


@dataclass(frozen=True)
class Release:
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
class LockInfo:
    """What an operator sees of one lock key.

    Attributes:
      key(str): The full key.
      lock(str): The lock type that took it.
      holders(dict[str, int]): owner -> deadline in Unix milliseconds.
      lock_args(str): JSON of the lock args, when they were recorded.
      fence(int): The last fencing token handed out.
    """

    key: str
    lock: Optional[str]
    holders: dict[str, int]
    lock_args: Optional[str] = None
    fence: int = 0


class LockBackend(abc.ABC):
    """ABC for lock backends.  Durations are in milliseconds."""

    #: True when :meth:`release_many` sends its releases in one round
    #: trip: the worker then releases run locks in the background.
    batches_releases: bool = False

    @abc.abstractmethod
    def acquire(
        self, key: str, owner: str, *, ttl: int, limit: int = 1, lock: str = "", lock_args: Optional[str] = None
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
        """
        raise NotImplementedError  # pragma: no cover

    @abc.abstractmethod
    def release(self, key: str, owner: str, *, hand_over: bool = True) -> Release:
        """Remove ``owner`` from ``key``, and hand the freed slot to the
        longest waiter of ``key``, if any (see :meth:`wait`).

        Parameters:
          hand_over(bool): False leaves the waiters waiting, for a caller
            that cannot enqueue the promoted message (an operator).
        """
        raise NotImplementedError  # pragma: no cover

    @abc.abstractmethod
    def wait(self, key: str, ticket: str, message: bytes, *, order: int, ttl: int) -> None:
        """Register an encoded message as waiting for ``key``.  Waiters
        are promoted in ``order``, lowest first.  A message that waits
        is also re-enqueued with a delay, so each ``ticket`` may arrive
        twice: :meth:`claim` lets only the first arrival run.

        Parameters:
          ticket(str): Names this wait, e.g. message id and attempt.
          ttl(int): How long the record lives, in milliseconds.
        """
        raise NotImplementedError  # pragma: no cover

    @abc.abstractmethod
    def claim(self, key: str, ticket: str) -> bool:
        """Record that one copy of ``ticket`` arrived.

        Returns:
          bool: False when another copy of the same ticket arrived
          first, so this one must be skipped; True otherwise,
          including for tickets with no record.
        """
        raise NotImplementedError  # pragma: no cover

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
    def inspect(self, key: str) -> Optional[LockInfo]:
        """Describe ``key``, or None when nobody holds it."""
        raise NotImplementedError  # pragma: no cover

    @abc.abstractmethod
    def scan(self, pattern: str) -> Iterator[str]:
        """Iterate over the held keys matching a glob ``pattern``."""
        raise NotImplementedError  # pragma: no cover

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Drop ``key`` and all its holders: an operator's override."""
        raise NotImplementedError  # pragma: no cover

    def release_many(self, locks: Sequence[tuple[str, str]]) -> list[Union[Release, Exception]]:
        """Release each ``(key, owner)`` and hand its slot over, as
        :meth:`release` does, in as few round trips as the backend can.

        Returns:
          list: per lock, its :class:`Release`, or the exception its
          release raised.
        """
        outcomes: list[Union[Release, Exception]] = []
        for key, owner in locks:
            try:
                outcomes.append(self.release(key, owner))
            except Exception as e:
                outcomes.append(e)
        return outcomes

    def take_run(
        self, key: str, owner: str, queue_key: str, queue_owner: str, *, ttl: int, limit: int = 1, lock: str = ""
    ) -> tuple[Acquisition, Optional[bool]]:
        """Acquire ``key`` for ``owner`` as :meth:`acquire` does and,
        only when that succeeds, release ``queue_key`` of
        ``queue_owner`` without a hand-over, in one round trip where the
        backend can.

        Returns:
          tuple: the :class:`Acquisition`, and whether ``queue_owner``
          still held ``queue_key`` (None when the enqueue lock was left
          alone: the run lock was not taken, or the release failed).
        """
        got = self.acquire(key, owner, ttl=ttl, limit=limit, lock=lock)
        if not got.acquired:
            return got, None
        try:
            return got, self.release(queue_key, queue_owner, hand_over=False).held
        except Exception:
            return got, None  # the caller releases the enqueue lock itself, and reports a failure

    def describe(self) -> str:
        """A short description for error messages, e.g. a URL."""
        return type(self).__name__
