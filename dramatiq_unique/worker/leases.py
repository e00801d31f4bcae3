"""Keeps the run leases of one worker process alive.

One daemon thread per process renews every held lease every lease/3
at most, in one round trip with every other lease due within half an
interval, so that a process's leases align and share their renewals.
A lease is lost when the backend says its owner no longer holds it, or
when renewals have failed until the lease's last known deadline has
passed.  A lost lease is reported once and never silently treated as
held.

Timeline of a lost lease, with a 60 s lease::

  t=0    worker A takes the lease (deadline t=60 on the server)
  t=20   renewal fails: Redis unreachable, or silent (a renewal that
         gets no answer is abandoned at the deadline, never awaited
         past it); A retries every second
  t=60   still failing: A's deadline has passed, so A reports the
         lease lost (ERROR log, ``lock_lost`` event); another worker
         may take the key from now on
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Optional

from dramatiq.logging import get_logger

from ..backends.base import LockBackend, NativeExtender, RenewsNatively
from ..background import BackgroundThread, DEFAULT_STOP_TIMEOUT, now_ms, pid

#: How soon a failed renewal is tried again, in milliseconds.
RETRY_INTERVAL = 1_000


class _Renewal:
    """One ``extend`` call on a daemon thread, so the keeper can stop
    waiting for it: a call stuck on a silent network (socket timeouts
    and client retries can add up to minutes) must not outlive the
    leases it renews.

    Not a :class:`~..background.BackgroundThread`: it is one call with a
    deadline, not a loop, so there is nothing to start lazily, stop or
    drain, and the keeper (which is one) refuses a new renewal while an
    abandoned one still waits.  Used only when renewals run through the
    backend's own client: under gevent that is a greenlet, on a backend
    with no native connection.
    """

    def __init__(self, extend: Callable[[], list[bool]]) -> None:
        self.done = threading.Event()
        self.held: list[bool] = []
        self.error: Optional[BaseException] = None
        threading.Thread(target=self._run, args=(extend,), name="dramatiq-unique-renewal", daemon=True).start()

    def _run(self, extend: Callable[[], list[bool]]) -> None:
        try:
            self.held = extend()
        except BaseException as e:
            self.error = e
        finally:
            self.done.set()

    def result(self, timeout: float) -> list[bool]:
        """The answer, waiting at most ``timeout`` milliseconds."""
        if not self.done.wait(max(timeout, 0) / 1000):
            raise TimeoutError(f"the lock backend did not answer within {max(timeout, 0):.0f} ms")
        if self.error is not None:
            raise self.error
        return self.held


@dataclass(eq=False)
class Lease:
    """A run lease held by this process."""

    key: str
    owner: str
    actor: str
    expires_at: float
    renew_at: float
    lost: bool = False


class LeaseKeeper:
    """Renews leases of ``lease`` milliseconds on ``backend``.

    Under gevent's monkey-patching the keeper runs on a native OS
    thread, with a connection of its own that no patched module touches
    (the backend's :class:`~..backends.base.NativeExtender`, see
    :class:`~..backends.base.RenewsNatively`), so that a lease is
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
        self.logger = get_logger(__name__, type(self))
        self.backend = backend
        self.lease = lease
        self.on_lost = on_lost
        self.on_error = on_error
        self._leases: dict[int, Lease] = {}
        self._renewal: Optional[_Renewal] = None
        self._native_extend: Optional[NativeExtender] = None
        self._thread = BackgroundThread(
            name="dramatiq-unique-leases", loop=self._serve, native=self._can_renew_natively, on_fork=self._forked
        )

    def _forked(self) -> None:
        # The parent's connection and renewal belong to the parent.
        self._renewal, self._native_extend = None, None

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
        self._renewal = _Renewal(lambda: self.backend.extend(locks, self.lease))
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
    """A :class:`~..backends.base.NativeExtender` of ``backend``, when it
    renews from a native thread (:class:`~..backends.base.RenewsNatively`)
    and this instance can; None otherwise (the caller renews on a
    greenlet).
    """
    return backend.native_extender() if isinstance(backend, RenewsNatively) else None
