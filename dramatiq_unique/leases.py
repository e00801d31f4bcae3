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
import time as mod_time
from dataclasses import dataclass
from typing import Callable, Optional

from dramatiq.logging import get_logger

from .backend import LockBackend
from .forks import pid

#: How soon a failed renewal is tried again, in milliseconds.
RETRY_INTERVAL = 1_000


def _now_ms() -> float:
    return mod_time.monotonic() * 1000


class _Renewal:
    """One ``extend`` call on a daemon thread, so the keeper can stop
    waiting for it: a call stuck on a silent network (socket timeouts
    and client retries can add up to minutes) must not outlive the
    leases it renews.
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
        self._wakeup = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        # The process the thread runs in: a forked child has none.  A
        # field read per job, where is_alive() costs two calls.
        self._running_in: Optional[int] = None
        self._stopping = False
        self._renewal: Optional[_Renewal] = None

    def hold(self, key: str, owner: str, taken_at: float, *, actor: str = "") -> Lease:
        """Start renewing a lease taken at monotonic ``taken_at`` ms."""
        lease = Lease(key, owner, actor, taken_at + self.lease, taken_at + self.lease / 3)
        # One dict store, atomic on its own: worker threads register and
        # drop a lease per job without contending for the renewal lock.
        self._leases[id(lease)] = lease
        if self._running_in != pid():
            with self._wakeup:
                if self._running_in != pid():
                    self._stopping = False
                    self._thread = threading.Thread(target=self._run, name="dramatiq-unique-leases", daemon=True)
                    self._thread.start()
                    self._running_in = pid()  # after start(): a thread that failed to start is tried again
        return lease

    def drop(self, lease: Lease) -> None:
        """Stop renewing ``lease``."""
        self._leases.pop(id(lease), None)

    def count(self, actor: Optional[str] = None) -> int:
        """How many leases this process holds, for one actor or all."""
        return sum(1 for lease in self._held() if actor in (None, lease.actor))

    def _held(self) -> list[Lease]:
        # A copy made in one call: the dict may change while it is read.
        return list(self._leases.values())

    def stop(self) -> None:
        """Stop the renewal thread; held leases then run out."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException:
            self._running_in = None  # the next lease starts a new thread
            raise

    def _serve(self) -> None:
        while True:
            with self._wakeup:
                if self._stopping:
                    self._running_in = None  # under the lock: a lease from now on starts a new thread
                    return
                now = _now_ms()
                held = self._held()
                following = min((lease.renew_at for lease in held), default=None)
                if following is None or following > now:
                    wait = self.lease / 3 if following is None else following - now
                    self._wakeup.wait(timeout=max(wait, 1) / 1000)
                    continue
                # Leases taken at different times fall due at different
                # times: renew with the first every lease due within half an
                # interval, so that they align and share one round trip.
                # Renewing early is safe; it only moves the deadline later.
                due = [lease for lease in held if lease.renew_at <= now + self.lease / 6]
            self.renew(due)

    def renew(self, due: list[Lease]) -> None:
        """Renew ``due`` leases now, in one round trip."""
        started = _now_ms()
        try:
            held = self._extend(due)
        except Exception as e:
            self.logger.warning("Could not renew %d lease(s): %r. Trying again.", len(due), e)
            for lease in due:
                if self.on_error is not None:
                    self.on_error(lease)
                lease.renew_at = min(_now_ms() + RETRY_INTERVAL, lease.expires_at)
                if _now_ms() >= lease.expires_at:
                    self._lose(lease)
            return
        for lease, still_held in zip(due, held):
            if still_held:
                lease.expires_at = started + self.lease
                lease.renew_at = started + self.lease / 3
            else:
                self._lose(lease)

    def _extend(self, due: list[Lease]) -> list[bool]:
        """Extend ``due`` leases, waiting for the answer no later than
        the first of their deadlines.
        """
        if self._renewal is not None and not self._renewal.done.is_set():
            raise TimeoutError("an earlier renewal is still waiting for the lock backend")
        locks = [(lease.key, lease.owner) for lease in due]
        self._renewal = _Renewal(lambda: self.backend.extend(locks, self.lease))
        return self._renewal.result(min(lease.expires_at for lease in due) - _now_ms())

    def _lose(self, lease: Lease) -> None:
        if self._leases.pop(id(lease), None) is None:
            return
        lease.lost = True
        self.on_lost(lease)
