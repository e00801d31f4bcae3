"""The send fast path: one round trip that takes a new message's enqueue
lock and enqueues it, when the locks live in the Redis broker's own
Redis.

The lock cannot be taken in ``before_enqueue`` and published in the
same round trip: ``before_enqueue`` of later middleware may still change
the message, and Dramatiq encodes it only afterwards.  So, for a new
send that takes an enqueue lock, ``before_enqueue`` only notes the lock
to take, and the broker's ``do_enqueue`` (the one place where Dramatiq
hands Redis the encoded message) runs one script: acquire.lua, then,
only when the lock was taken, the broker's own ``dispatch.lua`` with
exactly the arguments Dramatiq would have passed.  Every middleware
hook fires as before; a refused duplicate raises from ``do_enqueue``,
so nothing is enqueued and no ``after_enqueue`` fires.

The path is taken only when it is known to be exact, else the usual
two steps are: a ``RedisBroker`` itself (not a subclass), whose
``dispatch.lua`` is one this module knows; a lock backend on the same
standalone Redis; no later middleware with its own ``before_enqueue``
(it would otherwise see a refused duplicate that it never saw before);
and a new send, not a re-enqueue.
"""

from __future__ import annotations

import hashlib
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from dramatiq.common import current_millis
from dramatiq.middleware import Middleware

from .spec import ActorSpec

if TYPE_CHECKING:
    from dramatiq import Broker

    from .enqueue import EnqueueGuard

#: SHA1 of the ``dispatch.lua`` scripts whose ``enqueue`` command and
#: arguments this module reproduces: [command, timestamp, queue name,
#: broker id, heartbeat timeout, dead message ttl, do maintenance, max
#: unpack size, redis message id, encoded message].
KNOWN_DISPATCH = {
    "fdacc359c79a5adc3b8eeb53ff5772d7c42144e3": "dramatiq 2.x",
    "976fb89fbb3c404c8c7bed59060c56521eb9ba69": "dramatiq 1.17",
}

_BROKER_ATTRIBUTES = ("broker_id", "namespace", "heartbeat_timeout", "dead_message_ttl", "client")


@dataclass(frozen=True)
class _Deferred:
    """An enqueue lock noted in ``before_enqueue``, taken in ``do_enqueue``."""

    key: str
    ttl: int
    lock_args: Optional[str]
    spec: ActorSpec
    message: Any


#: Deferred locks of the enqueues in progress in this context, by
#: ``redis_message_id``: an enqueue whose hooks enqueue another message
#: keeps both apart.
_deferred: ContextVar[Optional[dict[str, _Deferred]]] = ContextVar("dramatiq_unique_deferred", default=None)

#: Deferred locks left by enqueues that never reached ``do_enqueue``
#: (a later ``before_enqueue`` raised) are dropped beyond this many.
_MAX_DEFERRED = 32


def dispatch_source(broker: Any) -> Optional[str]:
    """The broker's ``dispatch.lua`` when it is one this module knows
    and the broker is a plain ``RedisBroker``; None otherwise.
    """
    cls = type(broker)
    if cls.__name__ != "RedisBroker" or cls.__module__ != "dramatiq.brokers.redis":
        return None
    if not all(hasattr(broker, name) for name in _BROKER_ATTRIBUTES + ("_should_do_maintenance", "_max_unpack_size")):
        return None
    source = getattr(getattr(broker, "scripts", {}).get("dispatch"), "script", None)
    if isinstance(source, str):
        source = source.encode()
    if not isinstance(source, bytes) or hashlib.sha1(source).hexdigest() not in KNOWN_DISPATCH:
        return None
    return source.decode()


def _same_redis(a: Any, b: Any) -> bool:
    if a is b:
        return True
    kwargs = [getattr(getattr(c, "connection_pool", None), "connection_kwargs", None) for c in (a, b)]
    if kwargs[0] is None or kwargs[1] is None:
        return False
    where = ("host", "port", "path", "db", "username", "password")
    return all(kwargs[0].get(name) == kwargs[1].get(name) for name in where)


class SendPath:
    """The fast path of one middleware's enqueue guard."""

    def __init__(self, guard: "EnqueueGuard") -> None:
        self.guard = guard
        self._brokers: dict[int, str] = {}  # id(broker) -> dispatch source, for installed brokers

    def install(self, broker: "Broker") -> None:
        """Route ``broker.do_enqueue`` through the fast path, once, when
        the broker is one whose enqueue it can reproduce.
        """
        source = dispatch_source(broker)
        if source is None or getattr(broker.__dict__.get("do_enqueue"), "_unique_send_path", None) is self:
            return
        self._brokers[id(broker)] = source
        plain: Callable[..., Any] = broker._dispatch("enqueue")  # type: ignore[attr-defined]

        def do_enqueue(queue_name: str, redis_message_id: str, data: bytes) -> Any:
            pending = _deferred.get()
            deferred = pending.pop(redis_message_id, None) if pending else None
            if deferred is None:
                return plain(queue_name, redis_message_id, data)
            return self._send(broker, deferred, queue_name, redis_message_id, data, plain)

        do_enqueue._unique_send_path = self  # type: ignore[attr-defined]
        broker.do_enqueue = do_enqueue  # type: ignore[attr-defined]

    def defer(
        self, broker: "Broker", message: Any, delay: Optional[int], spec: ActorSpec, lock_args: Optional[str]
    ) -> bool:
        """Note the enqueue lock of a new send for ``do_enqueue`` to take.

        Returns:
          bool: False when the fast path does not apply here: take the
          lock now, in two steps.
        """
        middleware = self.guard.middleware
        backend = middleware.backend
        redis_message_id = message.options.get("redis_message_id")
        if (
            redis_message_id is None
            or id(broker) not in self._brokers
            or getattr(backend, "calls", None) is None
            or not _same_redis(backend.client, broker.client)  # type: ignore[union-attr,attr-defined]
            or self._later_hooks(broker)
        ):
            return False
        key = middleware.key(spec, message.options["unique_digest"], "queue")
        ttl = (delay or 0) + (spec.lock_ttl or middleware.settings.lock_ttl)
        pending = _deferred.get()
        if pending is None:
            pending = {}
            _deferred.set(pending)
        if len(pending) >= _MAX_DEFERRED:
            del pending[next(iter(pending))]
        pending[redis_message_id] = _Deferred(key, ttl, lock_args, spec, message)
        return True

    def _later_hooks(self, broker: "Broker") -> bool:
        """Whether a middleware after ours has a ``before_enqueue``."""
        stack = broker.middleware
        later = stack[stack.index(self.guard.middleware) + 1 :] if self.guard.middleware in stack else stack
        return any(type(m).before_enqueue is not Middleware.before_enqueue for m in later)

    def _send(
        self,
        broker: Any,
        deferred: _Deferred,
        queue_name: str,
        redis_message_id: str,
        data: bytes,
        plain: Callable[..., Any],
    ) -> None:
        middleware, spec, message, key = self.guard.middleware, deferred.spec, deferred.message, deferred.key
        arguments = [
            "enqueue",
            current_millis(),
            queue_name,
            broker.broker_id,
            broker.heartbeat_timeout,
            broker.dead_message_ttl,
            broker._should_do_maintenance("enqueue"),
            broker._max_unpack_size(),
            redis_message_id,
            data,
        ]
        try:
            got = middleware.backend.acquire_and_dispatch(  # type: ignore[union-attr]
                key,
                message.message_id,
                ttl=deferred.ttl,
                limit=spec.lock_limit,
                lock=spec.lock.name,
                lock_args=deferred.lock_args,
                dispatch=self._brokers[id(broker)],
                namespace=broker.namespace,
                arguments=arguments,
            )
        except Exception as e:
            error = middleware.backend_error("take the enqueue lock", key, spec, message, e)
            if middleware.settings.on_backend_error == "fail":
                # Whatever the script wrote before it failed stays: the
                # guarded enqueue releases the lock, if it was taken.
                self.guard.record_taken(key, message.message_id)
                raise error from e
            middleware.logger.warning("Enqueueing %s without its lock %r.", message, key)
            plain(queue_name, redis_message_id, data)
            return
        if not got.acquired:
            self.guard.refuse(message, spec, key, got.holder)
        if not got.reentered:
            self.guard.record_taken(key, message.message_id)
            middleware.emit("locked", spec, key, message)
