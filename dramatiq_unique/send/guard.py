"""Taking enqueue locks, cancelling a duplicate enqueue, and newest
wins: ``on_conflict="replace"`` and trailing-edge ``debounce``.

Dramatiq 2.x has no supported way for middleware to cancel an enqueue:
an exception from ``before_enqueue`` either reaches the caller or is
ignored.  So the middleware wraps its broker's ``enqueue`` once.  The
wrapper turns a refused duplicate into a returned, unsent message, and
releases any lock its call took when the publish fails.  That covers
``send``, ``send_with_options``, ``broker.enqueue``, pipelines, groups
and callbacks alike.

A new lock is taken for the provisional window only, and confirmed to
its full lifetime by the process's :class:`~.confirm.Confirmer` once
the publish has returned (see :mod:`dramatiq_unique.send.confirm`): a
producer that dies in between leaves a key that frees itself.  On the
Redis broker's own Redis, a new send takes its lock with its publish
instead, in one round trip (see :mod:`dramatiq_unique.send.fastpath`).

Under replace nothing is deleted from a queue.  A replacing send makes
itself the current holder of the enqueue lock in one round trip and
records the message it superseded (``replace.lua``).  Every later copy
of the superseded message (the original, a retry, a delay-queue move, a
redelivery, a reschedule or hand-off copy) is skipped when a worker
delivers it (``current.lua``, read by :mod:`..worker.superseded`).  That
needs no scan of a queue, works on any broker, and touches one digest's
keys only.  ``debounce`` is replace plus a delay: each send is due
``debounce`` ms later, so only the newest of a burst is still current
when it comes due; ``debounce_max`` caps the delay at that long after
the burst's first send, which the lock records.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from dramatiq.common import current_millis
from dramatiq.middleware import MiddlewareError

from ..backends.base import CurrentStatus, NewestWins, ReplaceStatus
from ..compat import replace_broker_enqueue
from ..errors import DuplicateMessage
from ..events import LockEvent
from ..model.spec import ActorSpec
from ..model.wire import QUEUE, RUN, UNIQUE_DIGEST, UNIQUE_DUPLICATE_OF, UNIQUE_LOCK_ARGS, UNIQUE_REPLACED
from .confirm import Confirmer, Pending
from .context import (
    CURRENT_CALL,
    EnqueueLocks,
    GuardedCall,
    LockContext,
    Refused,
    copy_of,
    is_fresh,
    send_sequence,
    store_failure,
)
from .fastpath import SendPath

if TYPE_CHECKING:
    from dramatiq import Broker


class EnqueueGuard:
    """Takes enqueue locks for one middleware and guards its brokers.

    Parameters:
      service(LockContext): The middleware's lock context.
      middleware(Middleware): The middleware itself, as it stands in a
        broker's stack: the send fast path checks what comes after it.
    """

    def __init__(self, service: LockContext, *, middleware: Any) -> None:
        self.service = service
        self.locks = EnqueueLocks(service)
        self._confirmer: Optional[Confirmer] = None
        self._confirmer_mutex = threading.Lock()
        self.send_path = SendPath(self.locks, middleware=middleware)

    def install(self, broker: "Broker") -> None:
        """Wrap ``broker.enqueue``, once, and route the Redis broker's
        publish through the send fast path where it applies.
        """
        if getattr(broker.enqueue, "_unique_guard", None) is self:
            return
        self.send_path.install(broker)
        namespace = getattr(broker, "namespace", None)
        self.locks.namespace = namespace if isinstance(namespace, str) else None
        original: Callable[..., Any] = broker.enqueue

        @functools.wraps(original)
        def enqueue(message: Any, *, delay: Optional[int] = None) -> Any:
            delay = self.debounce_delay(message, delay)
            call = GuardedCall()
            token = CURRENT_CALL.set(call)
            try:
                sent = original(message, delay=delay)
            except Refused as refused:
                unsent = message.copy(options={UNIQUE_DUPLICATE_OF: refused.holder})
                duplicate = DuplicateMessage(str(refused), key=refused.key, holder=refused.holder)
                store_failure(broker, unsent, duplicate)  # a caller waiting on it learns why at once
                return unsent
            except BaseException:
                self._restore(message, call.taken)
                self._release_all(call.taken, message.actor_name)
                raise
            finally:
                CURRENT_CALL.reset(token)
            if call.provisional:
                self._confirm_all(call.provisional)
            return sent

        enqueue._unique_guard = self  # type: ignore[attr-defined]
        replace_broker_enqueue(broker, enqueue)

    def _release_all(self, taken: list[tuple[str, str]], actor: str) -> None:
        service = self.service
        for key, owner in taken:
            try:
                service.backend.release(key, owner)  # type: ignore[union-attr]
                service.logger.info("Released %r: its message was not enqueued.", key)
                service.events.emit(LockEvent("released", actor, key, owner))
            except Exception as e:
                service.logger.error("Could not release %r after a failed enqueue: %r", key, e)
                service.events.emit(LockEvent("backend_error", actor, key, owner))

    @property
    def confirmer(self) -> Confirmer:
        """This process's confirmer for the middleware's backend."""
        backend = self.service.backend
        assert backend is not None
        confirmer = self._confirmer
        if confirmer is not None and confirmer.backend is backend:
            return confirmer
        with self._confirmer_mutex:
            if self._confirmer is None or self._confirmer.backend is not backend:
                if self._confirmer is not None:
                    self._confirmer.stop(timeout=0)
                self._confirmer = Confirmer(backend, on_lapsed=self._lapsed)
            return self._confirmer

    def _confirm_all(self, provisional: list[Pending]) -> None:
        # The message is published: nothing here may raise to the caller.
        try:
            if len(provisional) > 1:
                # De-duplicated: a RabbitMQ publish retry re-enters the same lock.
                provisional = list({(lock.key, lock.owner): lock for lock in provisional}.values())
            self.confirmer.submit(provisional)
        except Exception as e:  # e.g. no new threads at interpreter shutdown
            self.service.logger.error(
                "Could not queue %d enqueue lock(s) for confirmation: %r; they lapse after the provisional window.",
                len(provisional),
                e,
            )

    def _lapsed(self, lock: Pending) -> None:
        self.service.events.emit(LockEvent("lock_lost", lock.actor, lock.key, lock.owner))

    def flush(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for this process's
        provisional locks to be confirmed.
        """
        return self._confirmer is None or self._confirmer.flush(timeout)

    def before_enqueue(
        self, message: Any, delay: Optional[int], spec: ActorSpec, *, fresh: bool, broker: Optional["Broker"] = None
    ) -> None:
        """Stamp the digest on a new message and take its enqueue lock,
        or leave it to the send fast path to take with the publish.

        A message that carries the stamp already is being re-enqueued
        (a retry, a delay-queue move, a reschedule, a publish retry):
        its lock is re-entered, and nothing here raises for it.
        """
        if UNIQUE_DIGEST not in message.options:
            message.options[UNIQUE_DIGEST] = spec.digest(message.args, message.kwargs)
            if spec.lock.run_lock:
                send_sequence.stamp(message)
        if spec.lock.run_lock:
            # The worker's run lock records the lock args from the message (see copy_of).
            recorded = self.locks.lock_args(message, spec, fresh)
            if recorded is not None:
                message.options.setdefault(UNIQUE_LOCK_ARGS, recorded)
        if spec.lock.queue_lock and not self.send_path.defer(message, delay, spec, fresh, broker):
            self._take(message, delay, spec, fresh)

    def _take(self, message: Any, delay: Optional[int], spec: ActorSpec, fresh: bool) -> None:
        """Take or re-enter the enqueue lock of ``message``.  Inside a
        guarded enqueue call a new lock holds for the provisional window
        only, and is confirmed once the publish returns.  Replacing
        actors take theirs in :meth:`_take_replacing`, at once for the full
        lifetime (no provisional window).
        """
        if spec.client == "replace":
            return self._take_replacing(message, delay, spec, fresh)
        service, locks = self.service, self.locks
        digest = message.options[UNIQUE_DIGEST]
        key = service.key(spec, digest, QUEUE)
        ttl = service.enqueue_ttl(spec, delay)
        call = CURRENT_CALL.get()
        window = service.settings.provisional_window if call is not None else 0
        started = time.monotonic() * 1000
        # A re-enqueued copy of a message that a reschedule made twice
        # over may not run (see Copy): it must not take the lock back.
        copy = None if fresh or not spec.lock.run_lock else copy_of(message, service.key(spec, digest, RUN))
        try:
            got = service.backend.acquire(  # type: ignore[union-attr]
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

    @property
    def _newest_wins(self) -> NewestWins:
        return NewestWins.require(self.service.locks, feature="on_conflict='replace'")

    def debounce_delay(self, message: Any, delay: Optional[int]) -> Optional[int]:
        """The delay to enqueue ``message`` with: for a new send of a
        debounced actor, at least its quiet window, so that the broker puts
        it on the delay queue; ``before_enqueue`` then sets its due time.
        """
        service = self.service
        spec = service.specs.get(message.actor_name)
        if spec is None or spec.debounce is None or not service.enabled or not is_fresh(message):
            return delay
        return max(delay or 0, spec.debounce)

    def _take_replacing(self, message: Any, delay: Optional[int], spec: ActorSpec, fresh: bool) -> None:
        """Take the enqueue lock of a message of a replacing actor: a new
        send replaces the current holder; a re-enqueue re-enters, unless its
        message was superseded.
        """
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
        got = self._newest_wins.replace(
            key,
            message.message_id,
            ttl=ttl,
            lock=spec.lock.name,
            lock_args=locks.lock_args(message, spec, True),
            # until_expired runs a key at most once per lock_ttl: once its
            # holder has started, a new send is a duplicate.
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
        status, other = self._newest_wins.current(
            key, message.message_id, reenter=True, ttl=ttl, lock=spec.lock.name, copy=copy, where=locks.where(message)
        )
        # SUPERSEDED goes on and is skipped when delivered: raising would
        # lose or strand a delay-queue move; REENTERED holds what it held.
        if status is CurrentStatus.MAY_NOT_RUN:
            self.service.logger.debug("Re-enqueued %s without its lock %r: %s.", message, key, other)
        elif status is CurrentStatus.CURRENT:
            locks.locked(message, spec, key)
        elif status is CurrentStatus.LAPSED:
            locks.lapsed(message, spec, key, other)

    def _restore(self, message: Any, taken: list[tuple[str, str]]) -> None:
        """After a failed publish, make the message that this send superseded
        current again, so that it runs; the guard then releases this send's
        own slot.  A backend failure here leaves the superseded message
        superseded, as the send's error tells its caller.
        """
        service = self.service
        spec = service.specs.get(message.actor_name)
        if spec is None or spec.client != "replace":
            return
        for key, owner in taken:
            try:
                previous = self._newest_wins.unreplace(key, owner)
            except Exception as e:
                service.backend_error("restore the message superseded by an unsent one in", key, spec, message, e)
                continue
            if previous is not None:
                service.logger.info(
                    "Message %s is current again in %r: its replacement was not enqueued.", previous, key
                )
