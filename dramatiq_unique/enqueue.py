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

from dramatiq.worker import ConsumerThread

from .errors import DuplicateMessage
from .events import LockEvent
from .sendpath import SendPath
from .spec import ActorSpec

if TYPE_CHECKING:
    from dramatiq import Broker

    from .middleware import UniqueMiddleware

#: The locks taken fresh during the current guarded enqueue call.
_taken: ContextVar[Optional[list[tuple[str, str]]]] = ContextVar("dramatiq_unique_taken", default=None)


class _Refused(DuplicateMessage):
    """A duplicate under ``on_conflict="log"``: the guarded enqueue
    returns the message without sending it.
    """


class EnqueueGuard:
    """Takes enqueue locks for one middleware and guards its brokers."""

    def __init__(self, middleware: "UniqueMiddleware") -> None:
        self.middleware = middleware
        self.send_path = SendPath(self)

    def install(self, broker: "Broker") -> None:
        """Wrap ``broker.enqueue``, once."""
        self.send_path.install(broker)
        if getattr(broker.enqueue, "_unique_guard", None) is self:
            return
        original: Callable[..., Any] = broker.enqueue
        release = self._release_all

        @functools.wraps(original)
        def enqueue(message: Any, *, delay: Optional[int] = None) -> Any:
            taken: list[tuple[str, str]] = []
            token = _taken.set(taken)
            try:
                return original(message, delay=delay)
            except _Refused as refused:
                return message.copy(options={"unique_duplicate_of": refused.holder})
            except BaseException:
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

    def before_enqueue(
        self, message: Any, delay: Optional[int], spec: ActorSpec, *, fresh: bool, broker: Optional["Broker"] = None
    ) -> None:
        """Stamp the digest on a new message and take its enqueue lock.

        A message that carries the stamp already is being re-enqueued
        (a retry, a delay-queue move, a reschedule, a publish retry):
        its lock is re-entered, and nothing here raises for it.
        """
        if "unique_digest" not in message.options:
            message.options["unique_digest"] = spec.digest(message.args, message.kwargs)
        if spec.lock.queue_lock and not (fresh and broker is not None and self._defer(broker, message, delay, spec)):
            self._take(message, delay, spec, fresh)

    def _defer(self, broker: "Broker", message: Any, delay: Optional[int], spec: ActorSpec) -> bool:
        """Leave a new send's lock to the fast path, when it applies."""
        return self.send_path.defer(broker, message, delay, spec, self._lock_args(message, spec, fresh=True))

    def _lock_args(self, message: Any, spec: ActorSpec, *, fresh: bool) -> Optional[str]:
        if not (fresh and self.middleware.record_lock_args):
            return None
        return spec.canonical(spec.key_material(message.args, message.kwargs))

    def record_taken(self, key: str, owner: str) -> None:
        """Note a lock this enqueue took fresh: released if it fails."""
        taken = _taken.get()
        if taken is not None:
            taken.append((key, owner))

    def refuse(self, message: Any, spec: ActorSpec, key: str, holder: Optional[str]) -> None:
        """Refuse a duplicate send (raises)."""
        self._refuse(message, spec, key, holder)

    def _take(self, message: Any, delay: Optional[int], spec: ActorSpec, fresh: bool) -> None:
        middleware = self.middleware
        key = middleware.key(spec, message.options["unique_digest"], "queue")
        ttl = (delay or 0) + (spec.lock_ttl or middleware.settings.lock_ttl)
        recorded = (
            spec.canonical(spec.key_material(message.args, message.kwargs))
            if fresh and middleware.record_lock_args
            else None
        )
        try:
            got = middleware.backend.acquire(  # type: ignore[union-attr]
                key, message.message_id, ttl=ttl, limit=spec.lock_limit, lock=spec.lock.name, lock_args=recorded
            )
        except Exception as e:
            error = middleware.backend_error("take the enqueue lock", key, spec, message, e)
            if fresh and middleware.settings.on_backend_error == "fail":
                message.options.pop("unique_digest", None)
                raise error from e
            middleware.logger.warning("Enqueueing %s without its lock %r.", message, key)
            return
        if got.acquired:
            taken = _taken.get()
            if not got.reentered and taken is not None:
                taken.append((key, message.message_id))
            if not got.reentered:
                middleware.emit("locked", spec, key, message)
            return
        if not fresh:
            middleware.logger.warning(
                "Lock %r of %s lapsed and is held by %s; enqueueing it anyway.", key, message, got.holder
            )
            middleware.emit("lock_lost", spec, key, message, got.holder)
            return
        self._refuse(message, spec, key, got.holder)

    def _refuse(self, message: Any, spec: ActorSpec, key: str, holder: Optional[str]) -> None:
        middleware = self.middleware
        message.options.pop("unique_digest", None)
        middleware.emit("duplicate", spec, key, message, holder)
        text = f"Not enqueued: {message} duplicates message {holder}, which holds lock {key!r}."
        if spec.client == "raise":
            raise DuplicateMessage(text, key=key, holder=holder)
        middleware.logger.info("Duplicate %s not enqueued: lock %r is held by message %s.", message, key, holder)
        raise _Refused(text, key=key, holder=holder)
