"""What only some lock backends can do: abstract subclasses of
:class:`~.base.LockBackend` that a backend inherits when it can, checked
with ``isinstance`` (or :meth:`Capability.require`), never a class name or
``hasattr``.  Set-up refuses an actor that needs one its backend lacks
(:class:`MissingCapability`); see docs/architecture.md, "The backend seam".
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
    """The base of every capability."""

    #: What error messages call the capability.
    capability: ClassVar[str] = "a capability"

    @classmethod
    def require(cls: type[C], backend: LockBackend, *, feature: str) -> C:
        """``backend``, when it has this capability; else raises
        :class:`MissingCapability` naming the backend, the capability and
        ``feature``, what needs it (``"on_conflict='replace'"``).
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
    """The reschedule protocol, for ``on_conflict="reschedule"``: a message
    that meets a held run lock waits for it (:meth:`join_line`) and is
    enqueued again twice, delayed and handed over; the first copy to arrive
    runs (:meth:`claim`).  See ``docs/reliability.md``, "The hand-off model".
    """

    capability = "the reschedule protocol"

    @abc.abstractmethod
    def join_line(self, copy: Copy, message: bytes, *, order: int, ttl: int) -> int:
        """Register ``copy``'s message as waiting for ``copy.key``, ``message``
        the encoded copy to hand the key to, lowest ``order`` first, the
        records kept ``ttl`` ms.  The caller also enqueues a delayed copy:
        the first to arrive wins.  Returns how many waiters are ahead in line
        (0 when a wait sent again after its lost reply changed nothing).
        """

    @abc.abstractmethod
    def claim(self, copy: Copy) -> bool:
        """Settle that ``copy`` arrived, without taking a lock: True when it
        may run (the first of its attempt to arrive, withdrawing the waiter,
        a retry or redelivery of that one, or a copy with no record), False
        for an earlier attempt's or the second.
        """


class NewestWins(Capability):
    """Newest wins (``on_conflict="replace"``, ``debounce``): a send supersedes the lock's holder."""

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
        """Make ``owner`` the current holder of enqueue lock ``key`` (one
        slot), in one round trip, ``where`` as in :meth:`~LockBackend.acquire`.
        The superseded id is recorded ``superseded_ttl`` ms, so that its later
        copies are skipped.  A started holder keeps its slot (``keep_started``:
        the send is refused).  Under ``debounce`` (ms), the message is due
        that long from now, but at most ``debounce_max`` (when > 0) after the
        burst's first send, which the key records.
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
        """Whether message ``owner`` is still current under replace.  A
        delivery (no ``reenter``) marks a current message started; a re-enqueue
        re-enters its slot or takes the free key again, as
        :meth:`~LockBackend.acquire` does (``copy``, ``where`` alike).
        """
        return self._current(CurrentArgs(key, owner, reenter, ttl, lock, copy, where))

    @abc.abstractmethod
    def _current(self, call: CurrentArgs) -> CurrentCheck:
        """:meth:`current`, its arguments in one tuple."""

    @abc.abstractmethod
    def unreplace(self, key: str, owner: str) -> Optional[str]:
        """Undo the :meth:`replace` of ``owner``, whose message was never
        published: the one it superseded (returned, or None) is current again
        with ``owner``'s deadline, its slot left to :meth:`~LockBackend.release`.
        """


class DispatchFailed(Exception):
    """The broker's enqueue failed in :meth:`SendsWithPublish.acquire_and_dispatch`;
    the lock taken was dropped.  Raised as a subclass that is also the
    client's error, as the broker's enqueue would have raised.
    """


class SendsWithPublish(Capability):
    """Take an enqueue lock and run the Redis broker's enqueue script in one call (the send fast path)."""

    capability = "sending with the publish"

    @property
    @abc.abstractmethod
    def dispatch_client(self) -> Optional[Any]:
        """The client :meth:`acquire_and_dispatch` runs on, or None where it cannot (a Cluster)."""

    @abc.abstractmethod
    def acquire_and_dispatch(
        self, key: str, owner: str, *, dispatch: str, namespace: str, arguments: Sequence[Any], **take: Any
    ) -> Acquisition:
        """:meth:`~LockBackend.acquire` ``key`` with its keywords ``take``
        (``where`` required: the lock is confirmed), and only then run the
        broker's ``dispatch`` script with ``arguments`` under ``namespace``,
        in one round trip.  Only where :attr:`dispatch_client` is not None.

        Raises:
          DispatchFailed: ``dispatch`` failed; this call locked nothing.
        """


class BatchedReleases(Capability):
    """:meth:`~LockBackend.release_many` in one round trip, or with the next
    start: the worker then releases run locks off the worker thread.
    """

    capability = "batched releases"

    #: False where this instance cannot batch (a Redis Cluster).
    batches_releases: bool = True

    @abc.abstractmethod
    def release_and_start(
        self, releases: Sequence[tuple[Any, ...]], key: str, owner: str, **start: Any
    ) -> tuple[list[Union[Release, Exception]], Union[Start, Exception]]:
        """:meth:`~LockBackend.release_many` ``releases``, then
        :meth:`~LockBackend.start` ``key`` for ``owner`` with ``start``, in
        one round trip: each release's outcome, then the :class:`Start` or error.
        """


def release_then_start(
    backend: LockBackend, releases: Sequence[tuple[Any, ...]], key: str, owner: str, **start: Any
) -> tuple[list[Union[Release, Exception]], Union[Start, Exception]]:
    """:meth:`BatchedReleases.release_and_start` in two calls, on any backend."""
    released = backend.release_many(releases)
    try:
        return released, backend.start(key, owner, **start)
    except Exception as e:
        return released, e


class NativeExtender(Protocol):
    """:meth:`LockBackend.extend` on an unpatched connection of its own, so
    that a native thread under gevent touches no greenlet-patched socket or
    pool lock.  Used by one thread at a time.
    """

    def __call__(self, locks: Sequence[tuple[str, str]], ttl: int, *, timeout: float) -> list[bool]:
        """:meth:`LockBackend.extend`, waiting at most ``timeout`` ms (the lease deadline) for the whole exchange.

        Raises:
          TimeoutError: no answer in time, or ``timeout`` <= 0; connection closed.
          OSError: the connection failed; it is closed.
          RuntimeError: the backend refused the renewal.
        """
        ...  # pragma: no cover

    def close(self) -> None:
        """Close the connection; the next call opens a new one."""
        ...  # pragma: no cover


class RenewsNatively(Capability):
    """Renewal from a native thread: under gevent the lease keeper renews
    through :meth:`native_extender` on a native OS thread, so that leases
    renew while an actor holds the hub (a C call, a CPU loop).
    """

    capability = "renewal from a native thread"

    @abc.abstractmethod
    def native_extender(self) -> Optional[NativeExtender]:
        """A new :class:`NativeExtender`, or None when this instance cannot
        make one (TLS, Sentinel, a Cluster, a foreign client): renewals then
        run on a greenlet.  Called once per process, on the hub.
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
