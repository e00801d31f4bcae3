"""Taking enqueue locks, and cancelling a duplicate enqueue.

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
"""

from __future__ import annotations

import functools
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from ..compat import replace_broker_enqueue
from ..errors import DuplicateMessage
from ..events import LockEvent
from ..model.spec import ActorSpec
from ..model.wire import QUEUE, RUN, UNIQUE_DIGEST, UNIQUE_DUPLICATE_OF
from . import replace
from .confirm import Confirmer, Pending
from .context import CURRENT_CALL, EnqueueLocks, GuardedCall, LockContext, Refused, is_fresh
from .copies import copy_of, send_sequence
from .fastpath import SendPath
from .results import store_failure

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
        release, confirm, service = self._release_all, self._confirm_all, self.service

        @functools.wraps(original)
        def enqueue(message: Any, *, delay: Optional[int] = None) -> Any:
            delay = replace.debounce_delay(service, message, delay)
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
                replace.restore(service, message, call.taken)
                release(call.taken, message.actor_name)
                raise
            finally:
                CURRENT_CALL.reset(token)
            if call.provisional:
                confirm(call.provisional)
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

    def is_fresh(self, message: Any) -> bool:
        """Whether this enqueue is a new send, which may be refused,
        rather than a re-enqueue, which must never raise.
        """
        return is_fresh(message)

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
            self.locks.stamp_lock_args(message, spec, fresh)
        if spec.lock.queue_lock and not self.send_path.defer(message, delay, spec, fresh, broker):
            self._take(message, delay, spec, fresh)

    def _take(self, message: Any, delay: Optional[int], spec: ActorSpec, fresh: bool) -> None:
        """Take or re-enter the enqueue lock of ``message``.  Inside a
        guarded enqueue call a new lock holds for the provisional window
        only, and is confirmed once the publish returns.  Replacing
        actors take theirs in :mod:`.replace`, at once for the full
        lifetime (no provisional window).
        """
        if spec.client == "replace":
            return replace.take(self.locks, message, delay, spec, fresh)
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
