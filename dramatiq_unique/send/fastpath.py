"""The send fast path: one round trip that takes a new message's enqueue lock and enqueues it, when
the locks live in the Redis broker's own Redis.

Dramatiq encodes the message only after every ``before_enqueue`` ran, so ``before_enqueue`` only
notes the lock, and the broker's ``do_enqueue`` (where Dramatiq hands Redis the encoded message)
runs one script: acquire.lua, then, only if the lock was taken, the broker's own ``dispatch.lua``
with Dramatiq's exact arguments.  A refused duplicate raises from ``do_enqueue`` (no
``after_enqueue``), and the guarded call returns it unsent, as on the two-step path.  The lock is
taken confirmed: a producer dying at any point leaves both the lock and its message, or neither.

The path is taken only where it is known to be exact: a plain ``RedisBroker`` with a known
``dispatch.lua`` and its own ``do_enqueue``, a :class:`~..backends.capabilities.SendsWithPublish`
backend on the same standalone database, no later ``before_enqueue`` (it would see a refused
duplicate it never saw before), and a new send (re-enqueues never raise).  Its use of the broker's
private methods pays: ~1.6 x the enqueue rate.  See docs/reliability.md, "The send fast path: no
orphan on the Redis broker's own Redis", and docs/architecture.md for the figures.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, Optional

from dramatiq.common import current_millis
from dramatiq.middleware import Middleware

from ..backends.base import LockBackend
from ..backends.capabilities import DispatchFailed, SendsWithPublish
from ..compat import RedisDispatch, redis_dispatch, replace_redis_do_enqueue
from ..model.spec import ActorSpec
from ..model.wire import QUEUE, UNIQUE_DIGEST
from .context import CURRENT_CALL, Deferred, EnqueueLocks, maybe_applied

if TYPE_CHECKING:
    from dramatiq import Broker

#: SHA1 of the ``dispatch.lua`` scripts whose ``enqueue`` arguments :meth:`SendPath._send` reproduces.
KNOWN_DISPATCH = {
    "fdacc359c79a5adc3b8eeb53ff5772d7c42144e3": "dramatiq 2.2",
    "976fb89fbb3c404c8c7bed59060c56521eb9ba69": "dramatiq 1.17",
}

#: The public broker attributes the fast path reads (the private methods it calls are in compat).
_BROKER_ATTRIBUTES = ("broker_id", "namespace", "heartbeat_timeout", "dead_message_ttl", "client", "scripts")

#: The connection parameters that say two clients reach one database.
_WHERE = ("host", "port", "path", "db", "username", "password")


def dispatch_source(broker: Any) -> Optional[str]:
    """A plain ``RedisBroker``'s ``dispatch.lua``, when this module knows it; else None."""
    cls = type(broker)
    if cls.__name__ != "RedisBroker" or cls.__module__ != "dramatiq.brokers.redis":
        return None
    if not all(hasattr(broker, name) for name in _BROKER_ATTRIBUTES) or redis_dispatch(broker) is None:
        return None
    source = getattr(broker.scripts.get("dispatch"), "script", None)
    if isinstance(source, str):
        source = source.encode()
    if not isinstance(source, bytes) or hashlib.sha1(source).hexdigest() not in KNOWN_DISPATCH:
        return None
    return source.decode()


def _standalone(client: Any) -> Optional[dict[str, Any]]:
    """The connection parameters of a plain standalone client; None for Cluster, Sentinel and others."""
    import redis  # only a Redis broker gets here

    pool: Any = getattr(client, "connection_pool", None)
    if type(client) is not redis.Redis or type(pool) not in (redis.ConnectionPool, redis.BlockingConnectionPool):
        return None
    kwargs: dict[str, Any] = pool.connection_kwargs
    return kwargs


def same_redis(backend: Optional[LockBackend], broker: Any) -> bool:
    """Whether ``backend`` can take a lock and publish in one call on ``broker``'s standalone database."""
    client = backend.dispatch_client if isinstance(backend, SendsWithPublish) else None
    if client is None:
        return False
    a, b = _standalone(client), _standalone(broker.client)
    if a is None or b is None:
        return False
    return all(a.get(name, 0 if name == "db" else None) == b.get(name, 0 if name == "db" else None) for name in _WHERE)


def _later_hooks(broker: "Broker", middleware: Any) -> bool:
    stack = broker.middleware
    later = stack[stack.index(middleware) + 1 :] if middleware in stack else stack
    return any(type(m).before_enqueue is not Middleware.before_enqueue for m in later)


class SendPath:
    """The fast path of one middleware's enqueue guard: the module docstring says when it applies."""

    def __init__(self, locks: EnqueueLocks, *, middleware: Any) -> None:
        self.locks = locks
        self.service = locks.service
        self.middleware = middleware
        #: (backend, broker client, middleware stack, its length, verdict) of :meth:`applies`'s last call.
        self._verdict: Optional[tuple[Any, Any, Any, int, bool]] = None

    def install(self, broker: "Broker") -> None:
        """Route ``broker.do_enqueue`` through the fast path, once, if it can reproduce its enqueue."""
        source = dispatch_source(broker)
        if source is None or "do_enqueue" in broker.__dict__:  # ours already, or someone else's
            return
        internals = redis_dispatch(broker)
        assert internals is not None  # dispatch_source checked
        plain, take_deferred = internals.enqueue, self.take_deferred

        def do_enqueue(queue_name: str, redis_message_id: str, data: bytes) -> Any:
            deferred = take_deferred(redis_message_id)
            if deferred is None:
                return plain(queue_name, redis_message_id, data)
            return self._send(broker, internals, source, deferred, queue_name, redis_message_id, data)

        do_enqueue._unique_send_path = self  # type: ignore[attr-defined]
        replace_redis_do_enqueue(broker, do_enqueue)

    def applies(self, broker: "Broker") -> bool:
        """Whether a new send on ``broker`` may take the fast path now."""
        if getattr(broker.__dict__.get("do_enqueue"), "_unique_send_path", None) is not self:
            return False
        # Redrawn only when backend, client or stack change (middleware is added, never swapped in).
        backend, client, stack = self.service.backend, getattr(broker, "client", None), broker.middleware
        last = self._verdict
        if last is not None and all(a is b for a, b in zip(last, (backend, client, stack))) and last[3] == len(stack):
            return bool(last[4])
        verdict = same_redis(backend, broker) and not _later_hooks(broker, self.middleware)
        self._verdict = (backend, client, stack, len(stack), verdict)
        return verdict

    def defer(self, message: Any, delay: Optional[int], spec: ActorSpec, fresh: bool, broker: Any) -> bool:
        """Note a new send's enqueue lock for the broker's publish to take, in one round trip; False when
        the two-step path applies (re-enqueue, replacing actor, no guarded call, a broker it does not serve).
        """
        call = CURRENT_CALL.get()
        redis_message_id = message.options.get("redis_message_id")
        if (
            not fresh
            or spec.client == "replace"
            or call is None
            or broker is None
            or not isinstance(redis_message_id, str)
            or not self.applies(broker)
        ):
            return False
        locks = self.locks
        key = self.service.key(spec, message.options[UNIQUE_DIGEST], QUEUE)
        lock_args = locks.lock_args(message, spec, fresh)
        deferred = Deferred(key, self.service.enqueue_ttl(spec, delay), lock_args, locks.where(message), spec, message)
        if call.deferred is None:
            call.deferred = {}
        call.deferred[redis_message_id] = deferred
        return True

    def take_deferred(self, redis_message_id: str) -> Optional[Deferred]:
        """The lock noted for publishing ``redis_message_id`` in the current call, once; else None."""
        call = CURRENT_CALL.get()
        if call is None or not call.deferred:
            return None
        return call.deferred.pop(redis_message_id, None)

    def _send(
        self,
        broker: Any,
        internals: RedisDispatch,
        source: str,
        deferred: Deferred,
        queue_name: str,
        redis_message_id: str,
        data: bytes,
    ) -> None:
        """Take the deferred lock and enqueue, in one round trip."""
        spec, message, key = deferred.spec, deferred.message, deferred.key
        arguments = [
            "enqueue",
            current_millis(),
            queue_name,
            broker.broker_id,
            broker.heartbeat_timeout,
            broker.dead_message_ttl,
            internals.maintenance("enqueue"),
            internals.max_unpack_size(),
            redis_message_id,
            data,
        ]
        try:
            got = SendsWithPublish.require(self.service.locks, feature="the send fast path").acquire_and_dispatch(
                key,
                message.message_id,
                ttl=deferred.ttl,
                limit=spec.lock_limit,
                lock=spec.lock.name,
                lock_args=deferred.lock_args,
                where=deferred.where,
                dispatch=source,
                namespace=broker.namespace,
                arguments=arguments,
            )
        except DispatchFailed:
            raise  # the broker's own failure, as its enqueue raises it; nothing is locked
        except Exception as e:
            # Fail closed as take_failed does, or go on unlocked.  The call was also the publish, so a
            # timeout (may have locked and enqueued) raises even under run_unlocked, as the broker's
            # enqueue would.  Its lock is kept: one script did both or neither, so it matches the queue.
            if self.service.settings.on_backend_error != "fail" and maybe_applied(e):
                self.service.backend_error("take the enqueue lock", key, spec, message, e)
                raise
            self.locks.take_failed(message, spec, key, True, e, give_back=False)  # raises unless told to go on
            internals.enqueue(queue_name, redis_message_id, data)  # without its lock
            return
        if not got.acquired:  # a duplicate: its message was not enqueued
            self.locks.refuse(message, spec, key, got.holder)
        if not got.reentered:
            self.locks.locked(message, spec, key)
