"""Taking enqueue locks: the two steps of a new send (a provisional lock, then the publish), its
re-enqueues, and newest wins (``on_conflict="replace"``, trailing-edge ``debounce``).  Each runs in
the guarded enqueue call of :class:`~.context.EnqueueLocks`; on the Redis broker's own Redis a new
send takes its lock with its publish instead (:mod:`.fastpath`).

Replace deletes nothing from a queue: a replacing send makes itself the lock's current holder and
records the message it superseded (``replace.lua``), and a worker skips every later copy of that
message (``current.lua``, in :mod:`..worker.take`): no queue scan, any broker, one digest's keys.
``debounce`` is replace plus a delay, so only a burst's newest send is current when due;
``debounce_max`` caps it from the burst's first send, which the lock records.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Optional

from dramatiq.common import current_millis
from dramatiq.middleware import MiddlewareError

from ..backends.records import CurrentStatus, ReplaceStatus
from ..model.spec import ActorSpec
from ..model.wire import QUEUE, RUN, UNIQUE_DIGEST, UNIQUE_REPLACED
from .confirm import Pending
from .context import CURRENT_CALL, EnqueueLocks, copy_of
from .fastpath import SendPath

if TYPE_CHECKING:
    from dramatiq import Broker


class EnqueueGuard:
    """Takes enqueue locks for one middleware and guards its brokers (``middleware`` as it stands in their stacks)."""

    def __init__(self, locks: EnqueueLocks, *, middleware: Any) -> None:
        self.service = locks.service
        self.locks = locks
        self.send_path = SendPath(locks, middleware=middleware)

    def install(self, broker: "Broker") -> None:
        """Guard ``broker.enqueue``, once, and route the Redis broker's publish through the fast path."""
        if getattr(broker.enqueue, "_unique_guard", None) is self.locks:
            return
        self.send_path.install(broker)
        self.locks.guard(broker)

    def take(
        self, message: Any, delay: Optional[int], spec: ActorSpec, *, fresh: bool, broker: Optional["Broker"] = None
    ) -> None:
        """Take or re-enter the enqueue lock of a stamped message; a re-enqueue never raises here.  In a
        guarded call a new lock holds for the provisional window until the publish returns; replacing
        actors take theirs for the full lifetime at once.
        """
        if self.send_path.defer(message, delay, spec, fresh, broker):
            return
        if spec.client == "replace":
            return self._take_replacing(message, delay, spec, fresh)
        service, locks = self.service, self.locks
        digest = message.options[UNIQUE_DIGEST]
        key = service.key(spec, digest, QUEUE)
        ttl = service.enqueue_ttl(spec, delay)
        call = CURRENT_CALL.get()
        window = service.settings.provisional_window if call is not None else 0
        started = time.monotonic() * 1000
        # A re-enqueued copy of a message a reschedule doubled may not run (see Copy): it must not take the lock back.
        copy = None if fresh or not spec.lock.run_lock else copy_of(message, service.key(spec, digest, RUN))
        try:
            got = service.locks.acquire(
                key,
                message.message_id,
                ttl=ttl,
                limit=spec.lock_limit,
                lock=spec.lock.name,
                lock_args=locks.lock_args(message, spec, fresh),
                provisional=window,
                where=locks.where(message),
                copy=copy,
            )
        except Exception as e:
            locks.take_failed(message, spec, key, fresh, e)
            return
        if got.refused:
            service.logger.debug("Re-enqueued %s without its lock %r: %s.", message, key, got.refused)
            return
        if got.acquired:
            if got.provisional and call is not None:
                call.provisional.append(Pending(key, message.message_id, ttl, spec.actor_name, started + window))
            if not got.reentered:
                locks.locked(message, spec, key)
            return
        if not fresh:
            locks.lapsed(message, spec, key, got.holder)
            return
        locks.refuse(message, spec, key, got.holder)

    # Newest wins ----------------------------------------------------

    def _take_replacing(self, message: Any, delay: Optional[int], spec: ActorSpec, fresh: bool) -> None:
        """A new send replaces the current holder; a re-enqueue re-enters, unless superseded."""
        service = self.service
        key = service.key(spec, message.options[UNIQUE_DIGEST], QUEUE)
        ttl = service.enqueue_ttl(spec, delay)
        try:
            if fresh:
                self._replace(message, delay, spec, key, ttl)
            else:
                self._reenter(message, spec, key, ttl)
        except MiddlewareError:  # a refused duplicate
            raise
        except Exception as e:
            self.locks.take_failed(message, spec, key, fresh, e)

    def _replace(self, message: Any, delay: Optional[int], spec: ActorSpec, key: str, ttl: int) -> None:
        locks = self.locks
        got = locks.newest_wins.replace(
            key,
            message.message_id,
            ttl=ttl,
            lock=spec.lock.name,
            lock_args=locks.lock_args(message, spec, True),
            # until_expired runs a key at most once per lock_ttl: once started, a new send is a duplicate.
            keep_started=spec.lock.queue_release == "expiry",
            debounce=spec.debounce or 0,
            debounce_max=spec.debounce_max or 0,
            superseded_ttl=ttl,
            where=locks.where(message),
        )
        if got.status is ReplaceStatus.REFUSED:
            locks.refuse(message, spec, key, got.holder)
        if got.status is ReplaceStatus.REENTERED:
            return
        locks.locked(message, spec, key)
        if got.status is ReplaceStatus.REPLACED and got.holder is not None:
            message.options[UNIQUE_REPLACED] = got.holder
            self.service.logger.debug(
                "Message %s replaced message %s as holder of %r.", message.message_id, got.holder, key
            )
        if spec.debounce is not None and "eta" in message.options and (delay or 0) <= spec.debounce:
            # The broker set eta from the full window; the lock knows the burst.
            message.options["eta"] = current_millis() + got.delay

    def _reenter(self, message: Any, spec: ActorSpec, key: str, ttl: int) -> None:
        locks = self.locks
        # A copy of a reschedule that may not run must not take the lock back (see Copy).
        run_key = self.service.key(spec, message.options[UNIQUE_DIGEST], RUN)
        copy = copy_of(message, run_key) if spec.lock.run_lock else None
        status, other = locks.newest_wins.current(
            key, message.message_id, reenter=True, ttl=ttl, lock=spec.lock.name, copy=copy, where=locks.where(message)
        )
        # SUPERSEDED goes on, skipped when delivered: raising would lose or strand a delay-queue move.
        if status is CurrentStatus.MAY_NOT_RUN:
            self.service.logger.debug("Re-enqueued %s without its lock %r: %s.", message, key, other)
        elif status is CurrentStatus.CURRENT:
            locks.locked(message, spec, key)
        elif status is CurrentStatus.LAPSED:
            locks.lapsed(message, spec, key, other)
