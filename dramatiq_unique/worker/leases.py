"""A run lock while its delivery runs: the delivery's state, the lease
that keeps the lock alive, and an async actor's coroutine, which the
release waits for.

**State.**  :class:`Delivery` lives on the ``MessageProxy``; which copy
of its message a delivery is, and where it stands among its key's
waiters, is :mod:`..send.context`: the send side stamps both.  What a
release needs travels as data (:class:`LockToRelease`, and the
:class:`HandOff` it may leave to do), and :func:`fence_token` reads the
fencing token of the running message.

**Leases.**  One daemon thread per process (:class:`LeaseKeeper`)
renews every held lease every lease/3 at most, in one round trip with
every other lease due within half an interval, so that a process's
leases align and share their renewals.  A lease is lost when the
backend says its owner no longer holds it, or when renewals have failed
until the lease's last known deadline has passed.  A lost lease is
reported once and never silently treated as held.

Timeline of a lost lease, with a 60 s lease::

  t=0    worker A takes the lease (deadline t=60 on the server)
  t=20   renewal fails: Redis unreachable, or silent (a renewal that
         gets no answer is abandoned at the deadline, never awaited
         past it); A retries every second
  t=60   still failing: A's deadline has passed, so A reports the
         lease lost (ERROR log, ``lock_lost`` event); another worker
         may take the key from now on

**Async actors.**  Dramatiq runs an async actor's coroutine on its event
loop thread and waits for it on the worker thread.  When a time limit
interrupts the worker thread, Dramatiq cancels the coroutine and waits
one second for it; a coroutine that ignores the cancellation goes on
running after the worker thread has moved on and fired the after-hooks.
So each async actor's coroutine is wrapped, when the actor is declared
(:func:`track`), to tell the delivery when it really ends, and a release
that comes earlier is deferred until then, the lease renewed meanwhile.

**Hand-off polls.**  When a run lock is released, its longest waiter is
enqueued at once (the hand-off).  Dramatiq's Redis consumer then finds
it on its next poll, but a consumer whose queue was empty for the length
of a job has backed off to 40–160 ms between polls, and a chain of
same-key jobs pays that on every hand-off.  So, after this process hands
a key over on a queue it consumes, its consumer polls that queue at most
every ``poll`` milliseconds (Dramatiq's own first backoff step) until no
hand-off has happened for ``hold`` milliseconds; then its own backoff
comes back (:class:`HandoffPolls`).  Only the consumer's backoff cap
(``timeout``) changes, and only on Dramatiq's Redis consumer; with any
other broker this does nothing.
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

#: How soon a failed renewal is tried again, in milliseconds.
RETRY_INTERVAL = 1_000

#: The longest wait between two polls of a queue that just got a
#: hand-off, in milliseconds.
DEFAULT_POLL = 5

#: How long quick polling lasts after the last hand-off, in milliseconds.
DEFAULT_HOLD = 5_000

_fence: ContextVar[Optional[int]] = ContextVar("dramatiq_unique_fence", default=None)

#: The watch of the delivery the current worker thread runs; the event
#: loop thread sees it, as Dramatiq copies the worker's context there.
_current: ContextVar[Optional["CoroutineWatch"]] = ContextVar("dramatiq_unique_coroutine", default=None)


@dataclass(eq=False)
class Delivery:
    """What the middleware did for one delivery of a message.  It lives
    on the ``MessageProxy``, never in ``message.options``: Retries
    copies options into the retried message.
    """

    spec: ActorSpec
    digest: str
    run_key: Optional[str] = None
    run_owner: Optional[str] = None
    #: The backend confirmed the run lock: a release that finds it gone
    #: reports it lost.  A call whose reply was lost may have taken it
    #: unconfirmed; the release then cleans up without a report.
    run_confirmed: bool = False
    #: This copy settled its claim (see ``Copy``): it is the one that runs.
    claimed: bool = False
    #: For an async actor: whether its coroutine has really ended.
    coroutine: Optional[CoroutineWatch] = None
    lease: Optional[Lease] = None
    fence: Optional[int] = None
    keeps_queue_lock: bool = False
    queue_released: bool = False
    #: The middleware itself skipped this delivery on purpose (a
    #: reschedule, a copy that lost its claim): Dramatiq's WARNING
    #: "Message ... was skipped." says nothing an operator needs.
    quiet_skip: bool = False


class LockToRelease(NamedTuple):
    """What reporting the release of one lock of a delivery needs, on
    whichever thread its outcome arrives.
    """

    #: Where a waiter the release hands the key to is enqueued; None for
    #: an enqueue lock, which hands nothing over.
    broker: Optional["Broker"]
    message: Any
    spec: ActorSpec
    key: str
    owner: str
    lease: Optional[Lease] = None
    #: The backend confirmed the run lock: a release that finds it gone reports it lost.
    confirmed: bool = False
    #: The run succeeded: its release finishes its message.
    succeeded: bool = False


class HandOff(NamedTuple):
    """A run lock's key that a release handed to its longest waiter: the
    waiter's encoded copy, to enqueue off the worker thread.
    """

    broker: "Broker"
    key: str
    encoded: bytes


Outcome = Union[Release, Exception]


@dataclass(eq=False)
class PendingRelease:
    """One run lock to release.

    Attributes:
      key(str): The lock key.
      owner(str): The owner token of the execution that held it.
      actor(str): The actor, for events.
      lock(LockToRelease): What reporting its outcome needs.
    """

    key: str
    owner: str
    actor: str
    lock: Optional[LockToRelease] = None
    submitted_at: float = field(default_factory=now_ms)
    resent: bool = False  # sent again after a call that may have applied it was broken
    #: The run succeeded: its release finishes its message (see LockBackend.release).
    succeeded: bool = False
    #: How long the slot handed to a waiter stays reserved for it, in ms.
    reserve: int = DEFAULT_RESERVE

    def releasing(self) -> Releasing:
        """What :meth:`LockBackend.release_many` is given for it."""
        return Releasing(self.key, self.owner, self.succeeded, self.reserve)

    @property
    def options(self) -> dict[str, Any]:
        """The release call's keyword arguments, as a stopping worker
        hands the release on to the next (:class:`~.resend.OwedReleases`).
        """
        return {"succeeded": self.succeeded, "reserve": self.reserve}


#: A release and the hand-off its report left to do on the releaser thread.
FollowUp = tuple[PendingRelease, HandOff]


class ReleaseReports(Protocol):
    """Where a :class:`Releaser` reports outcomes.  ``released`` runs
    on the thread that sent the release, with the :class:`Release` or
    the exception the release raised, and may return a hand-off, which
    ``hand_over`` does on the releaser thread, so that no worker thread
    waits for it.
    """

    def released(self, pending: PendingRelease, outcome: Outcome) -> Optional[HandOff]: ...

    def hand_over(self, handoff: HandOff) -> None: ...


def delivery(message: "MessageProxy") -> Optional[Delivery]:
    """The middleware's state for ``message``, if it has any."""
    return getattr(message, "_unique_delivery", None)


def attach(message: "MessageProxy", state: Delivery) -> Delivery:
    message._unique_delivery = state  # type: ignore[attr-defined]
    return state


def fence_token(message: Any = None) -> Optional[int]:
    """The fencing token of the run lock held for the current message,
    or for ``message`` when given.

    The token grows every time a new holder takes the key.  Pass it to
    the system you write to and have it refuse writes carrying a token
    lower than one it has seen; that keeps a paused or partitioned
    holder whose lease ran out from overwriting newer work.

    Returns:
      int: or None when no run lock is held.
    """
    if message is None:
        return _fence.get()
    state = delivery(message)
    return state.fence if state is not None else None


#: Sets the fencing token of the running message: the context
#: variable's own method, so that a job's two calls run no Python.
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
    """Renews leases of ``lease`` milliseconds on ``backend``.

    Under gevent's monkey-patching the keeper runs on a native OS
    thread, with a connection of its own that no patched module touches
    (the backend's :class:`~..backends.capabilities.NativeExtender`, see
    :class:`~..backends.capabilities.RenewsNatively`), so that a lease is
    renewed while its actor holds the hub in a C call or a CPU loop;
    what it reports (a lost lease, a failed renewal, its logs) runs on
    the hub.  A backend with no such connection (the in-memory one, a
    Cluster, TLS, Sentinel) renews on a greenlet, as before, and says
    so once.

    Parameters:
      backend(LockBackend): Where the leases live.
      lease(int): The lease, in milliseconds.
      on_lost(callable): Called once with each lost :class:`Lease`.
      on_error(callable): Called with each :class:`Lease` whose
        renewal failed because the backend did.
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
        """Called at each start under gevent: find a native connection."""
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
        # One dict store, atomic on its own: worker threads register and
        # drop a lease per job without contending for a lock.  A new
        # lease falls due after every one held, so the keeper's wait
        # needs no wake-up.
        self._leases[id(lease)] = lease
        if self._thread.running_in != pid():
            self._thread.ensure_started()
        return lease

    def drop(self, lease: Lease) -> None:
        """Stop renewing ``lease``."""
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
        """Stop the renewal thread, waiting at most ``timeout`` ms; held
        leases then run out.
        """
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
            # Leases taken at different times fall due at different
            # times: renew with the first every lease due within half an
            # interval, so that they align and share one round trip.
            # Renewing early is safe; it only moves the deadline later.
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
        """Extend ``due`` leases, waiting for the answer no later than
        the first of their deadlines.
        """
        locks = [(lease.key, lease.owner) for lease in due]
        timeout = min(lease.expires_at for lease in due) - now_ms()
        if self._thread.native and self._native_extend is not None:
            # On this native thread, its own socket times the wait.
            return self._native_extend(locks, self.lease, timeout=timeout)
        if self._renewal is not None and not self._renewal.done.is_set():
            raise TimeoutError("an earlier renewal is still waiting for the lock backend")
        # On a daemon thread of its own, so that a renewal stuck on a silent network never outlives the
        # leases it renews; the keeper refuses a new one while an abandoned one still waits.
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
            call()  # on the keeper's own thread, as before: its errors reach the loop


def native_extend(backend: LockBackend) -> Optional[NativeExtender]:
    """A :class:`~..backends.capabilities.NativeExtender` of ``backend``, when it
    renews from a native thread (:class:`~..backends.capabilities.RenewsNatively`)
    and this instance can; None otherwise (the caller renews on a
    greenlet).
    """
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
            # Off the event loop: the deferred release makes a blocking call.
            # A one-off thread, not a BackgroundThread: one call, made
            # rarely (a coroutine that outlived its time limit), with no
            # loop to stop or drain; a greenlet under gevent, like the
            # event loop thread that calls this.
            threading.Thread(target=then, name="dramatiq-unique-late-release", daemon=True).start()

    def defer(self, then: Callable[[], None]) -> bool:
        """Run ``then`` when the coroutine ends, if it has not yet.

        Returns:
          bool: False when it has already ended: the caller goes on now.
        """
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
    """Wrap an async actor's coroutine so that its delivery's watch
    learns when it ends.  Other actors are left as they are.

    Returns:
      bool: Whether the actor is async, and so tracked.
    """
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
    """Speeds up this process's Redis consumers after a hand-off.

    Parameters:
      poll(int): The backoff cap while a hand-off may follow, in ms.
      hold(int): How long it lasts after the last hand-off, in ms.
    """

    def __init__(self, *, poll: int = DEFAULT_POLL, hold: int = DEFAULT_HOLD) -> None:
        self.poll = poll
        self.hold = hold
        self._threads: dict[str, Any] = {}  # queue name -> Dramatiq ConsumerThread
        self._saved: dict[int, tuple[Any, int]] = {}  # id(consumer) -> (consumer, its own timeout)
        self._until = 0.0  # monotonic ms
        self._lock = threading.Lock()
        # A greenlet under gevent: it writes the consumers' fields, which
        # the hub's greenlets read (and an actor that holds the hub only
        # delays the restore).
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
        """Restore the consumers' backoff once no hand-off came for
        ``hold`` ms.  The thread stays, asleep, for the next hand-off:
        one that ended could miss a hand-off made as it ended.
        """
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
