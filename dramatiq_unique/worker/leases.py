"""A run lock while its delivery runs: the delivery's state, the lease
that keeps the lock alive (:class:`LeaseKeeper`), an async actor's
coroutine, which the release waits for (:func:`track`), and the quick
polls after a hand-off (:class:`HandoffPolls`).  See
docs/reliability.md, "The worker's run lock".
"""

from __future__ import annotations

import functools
import inspect
import threading
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional, Protocol, Union

from dramatiq.common import q_name

from ..backends.base import LockBackend
from ..backends.capabilities import NativeExtender, RenewsNatively
from ..backends.records import DEFAULT_RESERVE, Release, Releasing
from ..background import DEFAULT_STOP_TIMEOUT, BackgroundThread, OneCall, ThreadOwner, now_ms, pid
from ..compat import async_to_sync, redis_consumer_backoff, replace_actor_fn, set_redis_consumer_backoff
from ..model.spec import ActorSpec

if TYPE_CHECKING:
    from dramatiq import Actor, Broker
    from dramatiq.broker import MessageProxy

#: Milliseconds before a failed renewal is tried again.
RETRY_INTERVAL = 1_000

#: The longest wait between polls of a queue that just got a hand-off, in ms.
DEFAULT_POLL = 5

#: How long quick polling lasts after the last hand-off, in milliseconds.
DEFAULT_HOLD = 5_000

_fence: ContextVar[Optional[int]] = ContextVar("dramatiq_unique_fence", default=None)

#: The current delivery's watch; Dramatiq copies it to the event loop thread.
_current: ContextVar[Optional["CoroutineWatch"]] = ContextVar("dramatiq_unique_coroutine", default=None)


@dataclass(eq=False)
class Delivery:
    """One delivery's state, on the ``MessageProxy``, not in ``message.options``, which Retries copies."""

    spec: ActorSpec
    digest: str
    run_key: Optional[str] = None
    run_owner: Optional[str] = None
    #: Confirmed: a release that finds it gone reports it lost (a lost reply may have taken it unconfirmed).
    run_confirmed: bool = False
    #: This copy settled its claim (see ``Copy``): it is the one that runs.
    claimed: bool = False
    coroutine: Optional[CoroutineWatch] = None
    lease: Optional[Lease] = None
    fence: Optional[int] = None
    keeps_queue_lock: bool = False
    queue_released: bool = False
    #: Skipped on purpose (a reschedule, a lost claim): no "was skipped" WARNING.
    quiet_skip: bool = False


class LockToRelease(NamedTuple):
    """What reporting a lock's release needs, on whichever thread its outcome arrives."""

    #: Where a waiter handed the key is enqueued; None for an enqueue lock.
    broker: Optional["Broker"]
    message: Any
    spec: ActorSpec
    key: str
    owner: str
    lease: Optional[Lease] = None
    confirmed: bool = False
    #: The run succeeded: its release finishes its message.
    succeeded: bool = False


class HandOff(NamedTuple):
    """A key handed to its longest waiter: the waiter's copy, to enqueue off the worker thread."""

    broker: "Broker"
    key: str
    encoded: bytes


Outcome = Union[Release, Exception]


@dataclass(eq=False)
class PendingRelease:
    """One run lock to release (``actor``: for events)."""

    key: str
    owner: str
    actor: str
    lock: Optional[LockToRelease] = None
    submitted_at: float = field(default_factory=now_ms)
    resent: bool = False  # sent again after a call that may have applied it was broken
    succeeded: bool = False
    #: How long the slot handed to a waiter stays reserved for it, in ms.
    reserve: int = DEFAULT_RESERVE

    def releasing(self) -> Releasing:
        """What :meth:`LockBackend.release_many` is given for it."""
        return Releasing(self.key, self.owner, self.succeeded, self.reserve)

    @property
    def options(self) -> dict[str, Any]:
        """The release call's keyword arguments, for :class:`~.resend.OwedReleases`."""
        return {"succeeded": self.succeeded, "reserve": self.reserve}


#: A release and the hand-off its report left to do on the releaser thread.
FollowUp = tuple[PendingRelease, HandOff]


class ReleaseReports(Protocol):
    """Where a :class:`Releaser` reports: ``released`` on the sending thread; the hand-off
    it may return, ``hand_over`` on the releaser thread, so that no worker thread waits for it.
    """

    def released(self, pending: PendingRelease, outcome: Outcome) -> Optional[HandOff]: ...

    def hand_over(self, handoff: HandOff) -> None: ...


def delivery(message: "MessageProxy") -> Optional[Delivery]:
    return getattr(message, "_unique_delivery", None)


def attach(message: "MessageProxy", state: Delivery) -> Delivery:
    message._unique_delivery = state  # type: ignore[attr-defined]
    return state


def fence_token(message: Any = None) -> Optional[int]:
    """The fencing token of the run lock held for the current message, or for ``message``; None when
    no run lock is held.

    The token grows with every new holder of the key.  Have the system you write to
    refuse tokens lower than one it has seen: a paused or partitioned holder whose
    lease ran out then cannot overwrite newer work.
    """
    if message is None:
        return _fence.get()
    state = delivery(message)
    return state.fence if state is not None else None


#: The context variable's own method, so that a job's two calls run no Python.
set_fence = _fence.set


@dataclass(eq=False)
class Lease:
    """A run lease held by this process."""

    key: str
    owner: str
    actor: str
    expires_at: float
    renew_at: float
    lost: bool = False


class LeaseKeeper(ThreadOwner[LockBackend]):
    """Renews leases of ``lease`` milliseconds on ``backend``; under gevent on a
    native thread, see docs/reliability.md, "Green threads (gevent)".  ``on_lost``
    is called once with each lost :class:`Lease`, ``on_error`` with each whose
    renewal failed.
    """

    def __init__(
        self,
        backend: LockBackend,
        *,
        lease: int,
        on_lost: Callable[[Lease], None],
        on_error: Optional[Callable[[Lease], None]] = None,
    ) -> None:
        self.lease = lease
        self.on_lost = on_lost
        self.on_error = on_error
        self._leases: dict[int, Lease] = {}
        self._forked()
        name = "dramatiq-unique-leases"
        super().__init__(backend, logger=__name__, name=name, native=self._can_renew_natively, on_fork=self._forked)

    def _forked(self) -> None:
        # The parent's connection and renewal belong to the parent.
        self._renewal: Optional[OneCall[list[bool]]] = None
        self._native_extend: Optional[NativeExtender] = None

    def _can_renew_natively(self) -> bool:
        """At each start under gevent: find a native connection."""
        if self._native_extend is None:
            self._native_extend = native_extend(self.backend)
        if self._native_extend is None:
            self.logger.warning(
                "gevent patched threads, and %s gives no connection for a native thread: leases renew on the hub, "
                "and an actor that blocks it for longer than the lease loses its lease.", self.backend.describe()
            )
        return self._native_extend is not None

    def hold(self, key: str, owner: str, taken_at: float, *, actor: str = "") -> Lease:
        """Start renewing a lease taken at monotonic ``taken_at`` ms."""
        lease = Lease(key, owner, actor, taken_at + self.lease, taken_at + self.lease / 3)
        # One atomic dict store: no lock per job.  It falls due after every held lease, so the keeper needs no wake-up.
        self._leases[id(lease)] = lease
        if self._thread.running_in != pid():
            self._thread.ensure_started()
        return lease

    def drop(self, lease: Lease) -> None:
        self._leases.pop(id(lease), None)

    def count(self, actor: Optional[str] = None) -> int:
        """How many leases this process holds, for one actor or all."""
        return sum(1 for lease in self._held() if actor in (None, lease.actor))

    @property
    def native(self) -> bool:
        """Whether renewals run on a native OS thread (gevent only)."""
        return self._thread.native and self._thread.running_in == pid()

    def _held(self) -> list[Lease]:
        # A copy made in one call: the dict may change while it is read.
        return list(self._leases.values())

    def stop(self, *, timeout: float = DEFAULT_STOP_TIMEOUT) -> None:
        """Stop renewing, waiting at most ``timeout`` ms; held leases then run out."""
        self._thread.stop(timeout=timeout)
        if self._native_extend is not None:
            self._native_extend.close()

    def _serve(self, thread: BackgroundThread) -> None:
        while not thread.stopping:
            now = now_ms()
            held = self._held()
            following = min((lease.renew_at for lease in held), default=None)
            if following is None or following > now:
                thread.wait(max(self.lease / 3 if following is None else following - now, 1))
                continue
            # With every lease due within half an interval: they align (docs/reliability.md, "Leases").
            self.renew([lease for lease in held if lease.renew_at <= now + self.lease / 6])

    def renew(self, due: list[Lease]) -> None:
        """Renew ``due`` leases now, in one round trip."""
        started = now_ms()
        try:
            held = self._extend(due)
        except Exception as e:
            self._failed(due, e)
            return
        for lease, still_held in zip(due, held):
            if still_held:
                lease.expires_at = started + self.lease
                lease.renew_at = started + self.lease / 3
            else:
                self._lose(lease)

    def _failed(self, due: list[Lease], error: Exception) -> None:
        self._report(lambda: self.logger.warning("Could not renew %d lease(s): %r. Trying again.", len(due), error))
        for lease in due:
            if self.on_error is not None:
                self._report(lambda lease=lease: self.on_error(lease))  # type: ignore[misc]
            lease.renew_at = min(now_ms() + RETRY_INTERVAL, lease.expires_at)
            if now_ms() >= lease.expires_at:
                self._lose(lease)

    def _extend(self, due: list[Lease]) -> list[bool]:
        """Extend ``due`` leases, waiting no later than the first of their deadlines."""
        locks = [(lease.key, lease.owner) for lease in due]
        timeout = min(lease.expires_at for lease in due) - now_ms()
        if self._thread.native and self._native_extend is not None:
            # On this native thread, its own socket times the wait.
            return self._native_extend(locks, self.lease, timeout=timeout)
        if self._renewal is not None and not self._renewal.done.is_set():
            raise TimeoutError("an earlier renewal is still waiting for the lock backend")
        # Its own daemon thread: one stuck on a silent network never outlives its leases.
        self._renewal = OneCall(lambda: self.backend.extend(locks, self.lease), name="dramatiq-unique-renewal")
        return self._renewal.result(timeout)

    def _lose(self, lease: Lease) -> None:
        if self._leases.pop(id(lease), None) is None:
            return
        lease.lost = True
        self._report(lambda: self.on_lost(lease))

    def _report(self, call: Callable[[], None]) -> None:
        if self._thread.native:
            self._thread.report(call)
        else:
            call()  # on the keeper's own thread: its errors reach the loop


def native_extend(backend: LockBackend) -> Optional[NativeExtender]:
    """``backend``'s :class:`~..backends.capabilities.NativeExtender`, or None (renew on a greenlet)."""
    return backend.native_extender() if isinstance(backend, RenewsNatively) else None


class CoroutineWatch:
    """Whether one delivery's coroutine has ended, and what to do then."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._ended = False
        self._then: Optional[Callable[[], None]] = None

    def ended(self) -> None:
        """Called on the event loop thread when the coroutine ends."""
        with self._mutex:
            self._ended, then = True, self._then
        if then is not None:
            # Off the event loop, the release blocks; one rare call, so no BackgroundThread.
            threading.Thread(target=then, name="dramatiq-unique-late-release", daemon=True).start()

    def defer(self, then: Callable[[], None]) -> bool:
        """Run ``then`` when the coroutine ends; False when it has ended already."""
        with self._mutex:
            if self._ended:
                return False
            self._then = then
            return True


def watch() -> CoroutineWatch:
    """A watch for the delivery starting on this thread."""
    current = CoroutineWatch()
    _current.set(current)
    return current


def track(actor: "Actor[Any, Any]") -> bool:
    """Wrap an async actor's coroutine to tell its delivery's watch when it ends; False if not async."""
    if getattr(actor.fn, "_unique_tracked", False):
        return True
    original = getattr(actor.fn, "__wrapped__", None)
    if not inspect.iscoroutinefunction(original):
        return False

    @functools.wraps(original)
    async def tracked(*args: Any, **kwargs: Any) -> Any:
        current = _current.get()
        try:
            return await original(*args, **kwargs)
        finally:
            if current is not None:
                current.ended()

    wrapped = async_to_sync(tracked)
    wrapped._unique_tracked = True  # type: ignore[attr-defined]
    replace_actor_fn(actor, wrapped)
    return True


class HandoffPolls:
    """Speeds up this process's Redis consumers after a hand-off: the backoff is capped at ``poll`` ms
    until ``hold`` ms after the last one.
    """

    def __init__(self, *, poll: int = DEFAULT_POLL, hold: int = DEFAULT_HOLD) -> None:
        self.poll = poll
        self.hold = hold
        self._threads: dict[str, Any] = {}  # queue name -> Dramatiq ConsumerThread
        self._saved: dict[int, tuple[Any, int]] = {}  # id(consumer) -> (consumer, its own timeout)
        self._until = 0.0  # monotonic ms
        self._lock = threading.Lock()
        # A greenlet under gevent: it writes fields the hub's greenlets read.
        self._timer = BackgroundThread(name="dramatiq-unique-handoff", loop=self._expire, on_fork=self._saved.clear)

    def consumer_booted(self, thread: Any) -> None:
        """Remember a consumer thread of this worker (``after_consumer_thread_boot``)."""
        queue = getattr(thread, "queue_name", None)
        if isinstance(queue, str) and queue == q_name(queue):
            self._threads[queue] = thread

    def handed_over(self, queue_name: str) -> None:
        """A message of ``queue_name`` was just handed a key."""
        consumer: Any = getattr(self._threads.get(q_name(queue_name)), "consumer", None)
        if redis_consumer_backoff(consumer) is None:
            return
        with self._lock:
            self._until = now_ms() + self.hold
            backoff = redis_consumer_backoff(consumer)  # read under the lock that guards its writes
            if id(consumer) not in self._saved and backoff is not None:
                self._saved[id(consumer)] = (consumer, backoff)
                set_redis_consumer_backoff(consumer, min(backoff, self.poll))
        if self._timer.running_in != pid():
            self._timer.ensure_started()

    def _expire(self, timer: BackgroundThread) -> None:
        """Restore the backoff once no hand-off came for ``hold`` ms; stays, asleep, for the next."""
        while not timer.stopping:
            with self._lock:
                left = self._until - now_ms()
                if left <= 0:
                    self._restore()
                    left = self.hold  # nothing to restore: look again, asleep, a hold later
            timer.wait(left)

    def _restore(self) -> None:
        for consumer, backoff in self._saved.values():
            set_redis_consumer_backoff(consumer, backoff)
        self._saved.clear()

    def stop(self) -> None:
        """Give every consumer its own backoff back."""
        self._timer.stop()
        with self._lock:
            self._restore()
