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
the publish has returned (see :mod:`dramatiq_unique.confirm`): a
producer that dies in between leaves a key that frees itself.  On the
Redis broker's own Redis, a new send takes its lock with its publish
instead, in one round trip (see :mod:`dramatiq_unique.sendpath`).
"""

from __future__ import annotations

import functools
import threading
import time
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Callable, Optional

from . import replace
from .compat import ConsumerThread
from .confirm import Confirmer, Pending
from .delivery import copy_of, send_sequence
from .errors import DuplicateMessage
from .events import LockEvent
from .results import store_failure
from .sendpath import Deferred, SendPath
from .spec import ActorSpec

if TYPE_CHECKING:
    from dramatiq import Broker

    from .backend import Acquisition
    from .context import GuardContext


class _Call:
    """What the current guarded enqueue call did to locks."""

    __slots__ = ("taken", "provisional", "deferred")

    def __init__(self) -> None:
        #: Locks taken fresh: released if the publish fails.
        self.taken: list[tuple[str, str]] = []
        #: Provisional locks: confirmed once the publish returns.
        self.provisional: list[Pending] = []
        #: Locks the send fast path takes with the publish, by
        #: ``redis_message_id`` (a hook may enqueue another message).
        self.deferred: Optional[dict[str, Deferred]] = None


_taken: ContextVar[Optional[_Call]] = ContextVar("dramatiq_unique_taken", default=None)


def _maybe_applied(error: Exception) -> bool:
    """Whether a failed call may have taken effect: a timeout (builtin,
    socket or redis-py) may have lost only its reply; a refused
    connection never sent anything.
    """
    return "timeout" in type(error).__name__.lower()


class _Refused(DuplicateMessage):
    """A duplicate under ``on_conflict="log"``: the guarded enqueue
    returns the message without sending it.
    """


class EnqueueGuard:
    """Takes enqueue locks for one middleware and guards its brokers."""

    def __init__(self, middleware: "GuardContext") -> None:
        self.middleware = middleware
        #: The Redis broker's namespace, to record where each message
        #: goes for the reaper; None on other brokers.
        self.namespace: Optional[str] = None
        self._confirmer: Optional[Confirmer] = None
        self._confirmer_mutex = threading.Lock()
        self.send_path = SendPath(self)

    def install(self, broker: "Broker") -> None:
        """Wrap ``broker.enqueue``, once, and route the Redis broker's
        publish through the send fast path where it applies.
        """
        if getattr(broker.enqueue, "_unique_guard", None) is self:
            return
        self.send_path.install(broker)
        namespace = getattr(broker, "namespace", None)
        self.namespace = namespace if isinstance(namespace, str) else None
        original: Callable[..., Any] = broker.enqueue
        release, confirm = self._release_all, self._confirm_all

        @functools.wraps(original)
        def enqueue(message: Any, *, delay: Optional[int] = None) -> Any:
            delay = replace.debounce_delay(self, message, delay)
            call = _Call()
            token = _taken.set(call)
            try:
                sent = original(message, delay=delay)
            except _Refused as refused:
                unsent = message.copy(options={"unique_duplicate_of": refused.holder})
                duplicate = DuplicateMessage(str(refused), key=refused.key, holder=refused.holder)
                store_failure(broker, unsent, duplicate)  # a caller waiting on it learns why at once
                return unsent
            except BaseException:
                replace.restore(self, message, call.taken)
                release(call.taken, message.actor_name)
                raise
            finally:
                _taken.reset(token)
            if call.provisional:
                confirm(call.provisional)
            return sent

        enqueue._unique_guard = self  # type: ignore[attr-defined]
        broker.enqueue = enqueue  # type: ignore[method-assign]

    def _release_all(self, taken: list[tuple[str, str]], actor: str) -> None:
        events = self.middleware.events
        for key, owner in taken:
            try:
                self.middleware.backend.release(key, owner)  # type: ignore[union-attr]
                self.middleware.logger.info("Released %r: its message was not enqueued.", key)
                events.emit(LockEvent("released", actor, key, owner))
            except Exception as e:
                self.middleware.logger.error("Could not release %r after a failed enqueue: %r", key, e)
                events.emit(LockEvent("backend_error", actor, key, owner))

    @property
    def confirmer(self) -> Confirmer:
        """This process's confirmer for the middleware's backend."""
        backend = self.middleware.backend
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
            self.middleware.logger.error(
                "Could not queue %d enqueue lock(s) for confirmation: %r; they lapse after the provisional window.",
                len(provisional),
                e,
            )

    def _lapsed(self, lock: Pending) -> None:
        self.middleware.events.emit(LockEvent("lock_lost", lock.actor, lock.key, lock.owner))

    def flush(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for this process's
        provisional locks to be confirmed.
        """
        return self._confirmer is None or self._confirmer.flush(timeout)

    def is_fresh(self, message: Any) -> bool:
        """Whether this enqueue is a new send, which may be refused,
        rather than a re-enqueue, which must never raise.
        """
        return "unique_digest" not in message.options and not isinstance(threading.current_thread(), ConsumerThread)

    def before_enqueue(
        self, message: Any, delay: Optional[int], spec: ActorSpec, *, fresh: bool, broker: Optional["Broker"] = None
    ) -> None:
        """Stamp the digest on a new message and take its enqueue lock,
        or leave it to the send fast path to take with the publish.

        A message that carries the stamp already is being re-enqueued
        (a retry, a delay-queue move, a reschedule, a publish retry):
        its lock is re-entered, and nothing here raises for it.
        """
        if "unique_digest" not in message.options:
            message.options["unique_digest"] = spec.digest(message.args, message.kwargs)
            if spec.lock.run_lock:
                send_sequence.stamp(message)
        if spec.lock.run_lock and fresh and self.middleware.record_lock_args:
            # The worker's run lock records them from the message (see copy_of).
            message.options.setdefault("unique_lock_args", self._lock_args(message, spec, fresh))
        if spec.lock.queue_lock and not self._defer(message, delay, spec, fresh, broker):
            self._take(message, delay, spec, fresh)

    def where(self, message: Any) -> str:
        """Where ``message`` is being published, as the reaper looks for
        it: ``namespace\tqueue\tredis_message_id`` on the Redis broker;
        on other brokers the namespace and id are empty (a RabbitMQ
        message cannot be looked up by id), the queue is still named.
        """
        redis_id = message.options.get("redis_message_id")
        if self.namespace is None or not isinstance(redis_id, str):
            return f"\t{message.queue_name}\t"
        return f"{self.namespace}\t{message.queue_name}\t{redis_id}"

    def _take(self, message: Any, delay: Optional[int], spec: ActorSpec, fresh: bool) -> None:
        """Take or re-enter the enqueue lock of ``message``.  Inside a
        guarded enqueue call a new lock holds for the provisional window
        only, and is confirmed once the publish returns.  Replacing
        actors take theirs in :mod:`.replace`, at once for the full
        lifetime (no provisional window).
        """
        if spec.client == "replace":
            return replace.take(self, message, delay, spec, fresh)
        middleware = self.middleware
        digest = message.options["unique_digest"]
        key = middleware.key(spec, digest, "queue")
        ttl = self._ttl(spec, delay)
        recorded = self._lock_args(message, spec, fresh)
        call = _taken.get()
        window = middleware.settings.provisional_window if call is not None else 0
        started = time.monotonic() * 1000
        # A re-enqueued copy of a message that a reschedule made twice
        # over may not run (see Copy): it must not take the lock back.
        copy = None if fresh or not spec.lock.run_lock else copy_of(message, middleware.key(spec, digest, "run"))
        try:
            got = middleware.backend.acquire(  # type: ignore[union-attr]
                key,
                message.message_id,
                ttl=ttl,
                limit=spec.lock_limit,
                lock=spec.lock.name,
                lock_args=recorded,
                provisional=window,
                where=self.where(message),
                copy=copy,
            )
        except Exception as e:
            self.take_failed(message, spec, key, fresh, e)
            return
        if got.refused:
            middleware.logger.debug("Re-enqueued %s without its lock %r: %s.", message, key, got.refused)
            return
        if got.acquired:
            if got.provisional and call is not None:
                call.provisional.append(Pending(key, message.message_id, ttl, spec.actor_name, started + window))
            if not got.reentered:
                self._record(key, message.message_id)
                middleware.emit("locked", spec, key, message)
            return
        if not fresh:
            middleware.logger.warning(
                "Lock %r of %s lapsed and is held by %s; enqueueing it anyway.", key, message, got.holder
            )
            middleware.emit("lock_lost", spec, key, message, got.holder)
            return
        self._refuse(message, spec, key, got.holder)

    def _ttl(self, spec: ActorSpec, delay: Optional[int]) -> int:
        """An enqueue lock's lifetime: ``lock_ttl`` from when the message is due."""
        return (delay or 0) + (spec.lock_ttl or self.middleware.settings.lock_ttl)

    def _lock_args(self, message: Any, spec: ActorSpec, fresh: bool) -> Optional[str]:
        """The lock args JSON a new send records, if the middleware records them."""
        if not (fresh and self.middleware.record_lock_args):
            return None
        stamped = message.options.get("unique_lock_args")
        if isinstance(stamped, str):
            return stamped
        return spec.canonical(spec.key_material(message.args, message.kwargs))

    # The send fast path (see sendpath) --------------------------------

    def _defer(self, message: Any, delay: Optional[int], spec: ActorSpec, fresh: bool, broker: Any) -> bool:
        """Note the enqueue lock of a new send for the broker's publish to
        take, in one round trip with it.

        Returns:
          bool: False when the two-step path applies: a re-enqueue, a
          replacing actor, an enqueue outside a guarded call, or a
          broker the fast path does not serve.
        """
        call = _taken.get()
        redis_message_id = message.options.get("redis_message_id")
        if (
            not fresh
            or spec.client == "replace"
            or call is None
            or broker is None
            or not isinstance(redis_message_id, str)
            or not self.send_path.applies(broker)
        ):
            return False
        key = self.middleware.key(spec, message.options["unique_digest"], "queue")
        lock_args = self._lock_args(message, spec, fresh)
        deferred = Deferred(key, self._ttl(spec, delay), lock_args, self.where(message), spec, message)
        if call.deferred is None:
            call.deferred = {}
        call.deferred[redis_message_id] = deferred
        return True

    def take_deferred(self, redis_message_id: str) -> Optional[Deferred]:
        """The lock noted for the publish of ``redis_message_id`` in the
        current guarded call, once; None when there is none to take.
        """
        call = _taken.get()
        if call is None or not call.deferred:
            return None
        return call.deferred.pop(redis_message_id, None)

    def took(self, message: Any, spec: ActorSpec, key: str, got: "Acquisition") -> None:
        """The fast path's lock call answered: refuse a duplicate (its
        message was not enqueued) or record the lock it took.
        """
        if not got.acquired:
            self._refuse(message, spec, key, got.holder)
        if not got.reentered:
            self._record(key, message.message_id)
            self.middleware.emit("locked", spec, key, message)

    def send_failed(self, message: Any, spec: ActorSpec, key: str, error: Exception) -> bool:
        """The fast path's call failed: fail closed as :meth:`take_failed`
        does, or go on unlocked.  The call was also the publish, so a
        timeout, which may have locked and enqueued, raises even when
        told to go on, as the broker's own enqueue would.  Its lock is
        kept: one script took it and enqueued, or did neither, so what
        it holds always matches the queue, and a send again is refused
        as a duplicate exactly when the first one went out.

        Returns:
          bool: True when the message is to be enqueued without its lock.
        """
        middleware = self.middleware
        if middleware.settings.on_backend_error != "fail" and _maybe_applied(error):
            middleware.backend_error("take the enqueue lock", key, spec, message, error)
            raise error
        self.take_failed(message, spec, key, True, error, give_back=False)
        return True

    def take_failed(
        self, message: Any, spec: ActorSpec, key: str, fresh: bool, error: Exception, *, give_back: bool = True
    ) -> None:
        """A call that takes the enqueue lock failed: a new send fails
        closed (unless told to go on unlocked); a re-enqueue goes on.
        ``give_back`` gives back a lock the call may have taken, when it
        fails closed: unless the same call also published the message.
        """
        middleware = self.middleware
        wrapped = middleware.backend_error("take the enqueue lock", key, spec, message, error)
        if fresh and middleware.settings.on_backend_error == "fail":
            message.options.pop("unique_digest", None)
            if give_back and _maybe_applied(error):
                # Only the reply may be lost: the guard gives back whatever
                # this new message holds (and what a replace superseded).
                self._record(key, message.message_id)
            raise wrapped from error
        middleware.logger.warning("Enqueueing %s without its lock %r.", message, key)

    def _record(self, key: str, owner: str) -> None:
        """Remember a lock this guarded call took, to give it back if
        the message is not enqueued after all.
        """
        call = _taken.get()
        if call is not None:
            call.taken.append((key, owner))

    def _refuse(self, message: Any, spec: ActorSpec, key: str, holder: Optional[str]) -> None:
        middleware = self.middleware
        message.options.pop("unique_digest", None)
        middleware.emit("duplicate", spec, key, message, holder)
        text = f"Not enqueued: {message} duplicates message {holder}, which holds lock {key!r}."
        if spec.client == "raise":
            raise DuplicateMessage(text, key=key, holder=holder)
        middleware.logger.info("Duplicate %s not enqueued: lock %r is held by message %s.", message, key, holder)
        raise _Refused(text, key=key, holder=holder)
