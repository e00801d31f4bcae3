"""Taking enqueue locks, and cancelling a duplicate enqueue.

Dramatiq 2.x has no supported way for middleware to cancel an enqueue:
an exception from ``before_enqueue`` either reaches the caller or is
ignored.  So the middleware wraps its broker's ``enqueue`` once.  The
wrapper turns a refused duplicate into a returned, unsent message, and
releases any lock its call took when the publish fails.  That covers
``send``, ``send_with_options``, ``broker.enqueue``, pipelines, groups
and callbacks alike.
"""

from __future__ import annotations

import functools
import threading
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Callable, Optional

from . import replace
from .compat import ConsumerThread
from .delivery import copy_of
from .errors import DuplicateMessage
from .events import LockEvent
from .results import store_failure
from .spec import ActorSpec

if TYPE_CHECKING:
    from dramatiq import Broker

    from .middleware import UniqueMiddleware

#: The locks taken fresh during the current guarded enqueue call.
_taken: ContextVar[Optional[list[tuple[str, str]]]] = ContextVar("dramatiq_unique_taken", default=None)


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

    def __init__(self, middleware: "UniqueMiddleware") -> None:
        self.middleware = middleware

    def install(self, broker: "Broker") -> None:
        """Wrap ``broker.enqueue``, once."""
        if getattr(broker.enqueue, "_unique_guard", None) is self:
            return
        original: Callable[..., Any] = broker.enqueue
        release = self._release_all

        @functools.wraps(original)
        def enqueue(message: Any, *, delay: Optional[int] = None) -> Any:
            delay = replace.debounce_delay(self, message, delay)
            taken: list[tuple[str, str]] = []
            token = _taken.set(taken)
            try:
                return original(message, delay=delay)
            except _Refused as refused:
                unsent = message.copy(options={"unique_duplicate_of": refused.holder})
                duplicate = DuplicateMessage(str(refused), key=refused.key, holder=refused.holder)
                store_failure(broker, unsent, duplicate)  # a caller waiting on it learns why at once
                return unsent
            except BaseException:
                replace.restore(self, message, taken)
                release(taken, message.actor_name)
                raise
            finally:
                _taken.reset(token)

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

    def is_fresh(self, message: Any) -> bool:
        """Whether this enqueue is a new send, which may be refused,
        rather than a re-enqueue, which must never raise.
        """
        return "unique_digest" not in message.options and not isinstance(threading.current_thread(), ConsumerThread)

    def before_enqueue(self, message: Any, delay: Optional[int], spec: ActorSpec, *, fresh: bool) -> None:
        """Stamp the digest on a new message and take its enqueue lock.

        A message that carries the stamp already is being re-enqueued
        (a retry, a delay-queue move, a reschedule, a publish retry):
        its lock is re-entered, and nothing here raises for it.
        """
        if "unique_digest" not in message.options:
            message.options["unique_digest"] = spec.digest(message.args, message.kwargs)
        if spec.lock.queue_lock:
            self._take(message, delay, spec, fresh)

    def _take(self, message: Any, delay: Optional[int], spec: ActorSpec, fresh: bool) -> None:
        if spec.client == "replace":
            return replace.take(self, message, delay, spec, fresh)
        middleware = self.middleware
        digest = message.options["unique_digest"]
        key = middleware.key(spec, digest, "queue")
        ttl = (delay or 0) + (spec.lock_ttl or middleware.settings.lock_ttl)
        recorded = (
            spec.canonical(spec.key_material(message.args, message.kwargs))
            if fresh and middleware.record_lock_args
            else None
        )
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
                copy=copy,
            )
        except Exception as e:
            error = middleware.backend_error("take the enqueue lock", key, spec, message, e)
            if fresh and middleware.settings.on_backend_error == "fail":
                message.options.pop("unique_digest", None)
                if _maybe_applied(e):
                    # Only the reply may be lost: the guard gives back
                    # whatever this new message holds.
                    self._record(key, message.message_id)
                raise error from e
            middleware.logger.warning("Enqueueing %s without its lock %r.", message, key)
            return
        if got.refused:
            middleware.logger.debug("Re-enqueued %s without its lock %r: %s.", message, key, got.refused)
            return
        if got.acquired:
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

    def _record(self, key: str, owner: str) -> None:
        """Remember a lock this guarded call took, to give it back if
        the message is not enqueued after all.
        """
        taken = _taken.get()
        if taken is not None:
            taken.append((key, owner))

    def _refuse(self, message: Any, spec: ActorSpec, key: str, holder: Optional[str]) -> None:
        middleware = self.middleware
        message.options.pop("unique_digest", None)
        middleware.emit("duplicate", spec, key, message, holder)
        text = f"Not enqueued: {message} duplicates message {holder}, which holds lock {key!r}."
        if spec.client == "raise":
            raise DuplicateMessage(text, key=key, holder=holder)
        middleware.logger.info("Duplicate %s not enqueued: lock %r is held by message %s.", message, key, holder)
        raise _Refused(text, key=key, holder=holder)
