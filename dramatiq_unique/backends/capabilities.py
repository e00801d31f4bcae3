"""The capabilities of a lock backend: what only some backends can do.

A capability is an abstract class deriving from the core
(:class:`~.base.LockBackend`), which a backend inherits when it can do
what the capability says; callers check it with ``isinstance`` (or
:meth:`Capability.require`), never by a backend's class name or
``hasattr``:

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
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar, Optional, Protocol, Sequence, TypeVar, Union

from ..errors import ConfigurationError
from .base import LockBackend
from .records import Acquisition, Copy, CurrentArgs, CurrentCheck, Release, ReplaceArgs, Replacement, Start


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


class NewestWins(Capability):
    """Newest wins: ``on_conflict="replace"`` and ``debounce``, where a
    send supersedes the message that holds the enqueue lock.
    """

    capability = "newest wins (replace, current, unreplace)"

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
        args = (key, owner, ttl, lock, lock_args, keep_started, debounce, debounce_max, superseded_ttl, where)
        return self._replace(ReplaceArgs(*args))

    @abc.abstractmethod
    def _replace(self, call: ReplaceArgs) -> Replacement:
        """:meth:`replace`, its arguments in one tuple."""

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
        return self._current(CurrentArgs(key, owner, reenter, ttl, lock, copy, where))

    @abc.abstractmethod
    def _current(self, call: CurrentArgs) -> CurrentCheck:
        """:meth:`current`, its arguments in one tuple."""

    @abc.abstractmethod
    def unreplace(self, key: str, owner: str) -> Optional[str]:
        """Undo the :meth:`replace` of ``owner``, whose message was never
        published: the message it superseded is current again, with
        ``owner``'s deadline.  ``owner``'s slot is left to
        :meth:`~LockBackend.release`.

        Returns:
          str: The message made current again, or None.
        """


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


class BatchedReleases(Capability):
    """Batched releases: :meth:`~LockBackend.release_many` sends its
    releases in one round trip, and :meth:`release_and_start` sends them
    with the next start.  The worker then releases run locks off the
    worker thread (:class:`~dramatiq_unique.worker.release.Releaser`).
    """

    capability = "batched releases"

    #: Whether this instance batches: False where it cannot (a Redis
    #: Cluster), which then releases as the core does.
    batches_releases: bool = True

    @abc.abstractmethod
    def release_and_start(
        self, releases: Sequence[tuple[Any, ...]], key: str, owner: str, **start: Any
    ) -> tuple[list[Union[Release, Exception]], Union[Start, Exception]]:
        """Release each of ``releases`` as
        :meth:`~LockBackend.release_many` does, then
        :meth:`~LockBackend.start` ``key`` for ``owner``, in one round
        trip (:func:`release_then_start` does it in two).

        Parameters:
          **start: The keyword arguments of :meth:`~LockBackend.start`
            (``ttl``, ``limit``, ``lock``, ``copy``, ``queue_key``,
            ``order``, ``reserve``).

        Returns:
          tuple: the outcome of each release, and the :class:`Start`, or
          the exception the start raised.
        """


def release_then_start(
    backend: LockBackend, releases: Sequence[tuple[Any, ...]], key: str, owner: str, **start: Any
) -> tuple[list[Union[Release, Exception]], Union[Start, Exception]]:
    """:meth:`BatchedReleases.release_and_start` in two calls: the
    releases, then the start (with the keyword arguments of
    :meth:`~LockBackend.start`), on any backend.
    """
    released = backend.release_many(releases)
    try:
        return released, backend.start(key, owner, **start)
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
