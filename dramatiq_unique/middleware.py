"""The ``UniqueMiddleware``: where each lock is taken and released.

Hook placement follows how Dramatiq 2.x fires its hooks:

* Locks taken at enqueue are owned by the message id, so Retries,
  delay-queue promotion, RabbitMQ publish retries and our own
  reschedule re-enter them; those paths never raise.
* The middleware moves itself before ``TimeLimit`` when the worker
  boots, so its after-hooks run after Retries has decided and cannot be
  interrupted by a time limit.
* Anything unexpected in ``before_process_message`` becomes a
  ``MiddlewareError``: the delivery fails and is retried, and the
  actor never runs without its lock.
"""

from __future__ import annotations

import random
import time
import uuid
from typing import TYPE_CHECKING, Any, Iterable, Optional

from dramatiq.logging import get_logger
from dramatiq.middleware import Middleware, MiddlewareError, Retries, SkipMessage

from . import settings as config
from .backend import LockBackend
from .backends.stub import StubBackend
from .delivery import Delivery, attach, delivery, set_fence
from .enqueue import EnqueueGuard
from .errors import ConfigurationError, LockBackendError, LockConflict, Rescheduled
from .events import EventHub, Listener, LockEvent
from .leases import Lease, LeaseKeeper
from .spec import ACTOR_OPTIONS, ActorSpec, actor_spec

if TYPE_CHECKING:
    from dramatiq import Actor, Broker, Worker
    from dramatiq.broker import MessageProxy

#: Middleware that must come after ours: their after-hooks then run
#: before ours, and their interrupts cannot land inside our hooks.
_RUN_AFTER = ("TimeLimit", "ShutdownNotifications", "Callbacks", "Pipelines", "Retries")


class UniqueMiddleware(Middleware):
    """Locks messages by a digest of their actor, queue and arguments.

    Parameters:
      backend(LockBackend): Where locks live.  Defaults to a
        ``RedisBackend`` on ``dramatiq_unique_redis_url``, else the
        broker's own Redis, else a ``StubBackend`` for a ``StubBroker``.
      redis_url(str): A Redis URL for the default backend.
      prefix(str): The prefix of every lock key.
      lock_ttl(int): Default lifetime of enqueue locks, in milliseconds,
        counted from when the message is due.
      lease(int): The lease of run locks, in milliseconds.
      reschedule_delay(int): Default delay of a rescheduled message, in
        milliseconds.
      enabled(bool): False turns all locking off.
      on_backend_error(str): ``"fail"`` never runs or enqueues a message
        without its lock; ``"run_unlocked"`` carries on without it.
      record_lock_args(bool): Store the lock args JSON with each enqueue
        lock, for operators.
      listeners(list[callable]): Called with every :class:`LockEvent`,
        like ``middleware.events.subscribe(listener)``.

    Every argument left as None is read from its ``dramatiq_unique_*``
    environment variable, or takes its ``DEFAULT_*`` value.

    Warning:
      Like every lease-based lock, this one is best effort under
      process pauses and Redis failover.  Guard writes that must never
      overlap with :func:`dramatiq_unique.fence_token`.
    """

    def __init__(
        self,
        *,
        backend: Optional[LockBackend] = None,
        redis_url: Optional[str] = None,
        prefix: Optional[str] = None,
        lock_ttl: Optional[int] = None,
        lease: Optional[int] = None,
        reschedule_delay: Optional[int] = None,
        enabled: Optional[bool] = None,
        on_backend_error: Optional[str] = None,
        record_lock_args: bool = False,
        listeners: Iterable[Listener] = (),
    ) -> None:
        self.logger = get_logger(__name__, type(self))
        self.settings = config.from_environment().merge(
            redis_url=redis_url,
            prefix=prefix,
            lock_ttl=lock_ttl,
            lease=lease,
            reschedule_delay=reschedule_delay,
            enabled=enabled,
            on_backend_error=on_backend_error,
        )
        if backend is not None and not isinstance(backend, LockBackend):
            raise ConfigurationError(
                f"backend={backend!r} is invalid: expected a LockBackend, e.g. RedisBackend(url=...)."
            )
        if not isinstance(record_lock_args, bool):
            raise ConfigurationError(f"record_lock_args={record_lock_args!r} is invalid: expected True or False.")
        self.enabled = self.settings.enabled
        self.record_lock_args = record_lock_args
        self.events = EventHub()
        for listener in listeners:
            self.events.subscribe(listener)
        self.specs: dict[str, ActorSpec] = {}
        self.backend = backend if backend is not None else self._backend_from_url()
        self._leases: Optional[LeaseKeeper] = None
        self._guard = EnqueueGuard(self)
        self._retries = True

    @property
    def actor_options(self) -> set[str]:
        return set(ACTOR_OPTIONS)

    # Set-up ---------------------------------------------------------

    def _backend_from_url(self) -> Optional[LockBackend]:
        if self.settings.redis_url is None:
            return None
        from .backends.redis import RedisBackend

        return RedisBackend(url=self.settings.redis_url)

    def attach(self, broker: "Broker") -> None:
        """Pick the backend for ``broker`` if none was given, and guard
        its ``enqueue``.  Called by the hooks; idempotent.
        """
        if self.backend is None:
            self.backend = self._backend_for(broker)
        self._guard.install(broker)

    def _backend_for(self, broker: "Broker") -> LockBackend:
        from dramatiq.brokers.stub import StubBroker

        client = getattr(broker, "client", None)
        if type(broker).__name__ == "RedisBroker" and client is not None:
            from .backends.redis import RedisBackend

            return RedisBackend(client=client)
        if isinstance(broker, StubBroker):
            return StubBackend()
        raise ConfigurationError(
            f"UniqueMiddleware has no lock backend for a {type(broker).__name__}. Set the "
            "dramatiq_unique_redis_url environment variable, or pass backend=RedisBackend(url=...)."
        )

    @property
    def leases(self) -> LeaseKeeper:
        if self._leases is None:
            assert self.backend is not None
            self._leases = LeaseKeeper(
                self.backend, lease=self.settings.lease, on_lost=self._lease_lost, on_error=self._renewal_failed
            )
        return self._leases

    def key(self, spec: ActorSpec, digest: str, phase: str) -> str:
        """The backend key of one lock: prefix, actor in clear text, and
        the digest inside a Cluster hash tag.
        """
        return f"{self.settings.prefix}:{spec.scope}:{{{digest}}}:{phase}"

    def emit(self, name: str, spec: ActorSpec, key: str, message: Any, holder: Optional[str] = None) -> None:
        message_id = getattr(message, "message_id", None)
        self.events.emit(LockEvent(name, spec.actor_name, key, message_id, holder and holder.split("/")[0]))

    def backend_error(self, action: str, key: str, spec: ActorSpec, message: Any, error: Exception) -> LockBackendError:
        """Log, count and wrap a backend failure."""
        assert self.backend is not None
        self.emit("backend_error", spec, key, message)
        where = self.backend.describe()
        self.logger.error("Lock backend %s failed to %s %r: %r", where, action, key, error)
        return LockBackendError(f"Lock backend {where} failed to {action} {key!r}: {error!r}", backend=where)

    # Declaration and boot ---------------------------------------------

    def before_declare_actor(self, broker: "Broker", actor: "Actor[Any, Any]") -> None:
        spec = actor_spec(actor)
        if spec is not None:
            self.attach(broker)
            self.specs[actor.actor_name] = spec

    def before_worker_boot(self, broker: "Broker", worker: "Worker") -> None:
        if self.specs:
            self.attach(broker)
        self._retries = any(isinstance(m, Retries) for m in broker.middleware)
        self._move_before_interrupters(broker)

    def _move_before_interrupters(self, broker: "Broker") -> None:
        # Safe while emit_before iterates: only earlier items shift, and
        # the one shifted into our old slot was already visited.
        stack = broker.middleware
        targets = [i for i, m in enumerate(stack) if type(m).__name__ in _RUN_AFTER]
        here = stack.index(self)
        if targets and min(targets) < here:
            stack.insert(min(targets), stack.pop(here))
            self.logger.debug("Moved UniqueMiddleware before %s.", type(stack[min(targets) + 1]).__name__)

    def after_worker_shutdown(self, broker: "Broker", worker: "Worker") -> None:
        if self._leases is not None:
            self._leases.stop()

    # Enqueue --------------------------------------------------------

    def before_enqueue(self, broker: "Broker", message: Any, delay: Optional[int]) -> None:
        spec = self.specs.get(message.actor_name)
        if spec is not None and self.enabled:
            self._guard.before_enqueue(broker, message, delay, spec)

    # Processing -----------------------------------------------------

    def before_process_message(self, broker: "Broker", message: "MessageProxy") -> None:
        spec = self.specs.get(message.actor_name)
        if spec is None or not self.enabled:
            return
        try:
            self._start(broker, message, spec)
        except MiddlewareError:
            raise
        except Exception as e:
            raise self.backend_error("lock", message.options.get("unique_digest", "?"), spec, message, e) from e

    def _start(self, broker: "Broker", message: "MessageProxy", spec: ActorSpec) -> None:
        stamped = message.options.get("unique_digest")
        digest = stamped or spec.digest(message.args, message.kwargs)
        message.options["unique_digest"] = digest  # so a retry re-enters, even if the sender had no middleware
        # An unstamped message took no enqueue lock (sent while disabled, or without the middleware): none to release.
        state = attach(message, Delivery(spec, digest, queue_released=not stamped))
        if spec.lock.run_lock:
            self._take_run_lock(broker, message, state)
        if spec.lock.queue_release == "run_start":
            self._release_queue_lock(message, state, strict=True)

    def _take_run_lock(self, broker: "Broker", message: "MessageProxy", state: Delivery) -> None:
        spec = state.spec
        key = self.key(spec, state.digest, "run")
        if not self._claim(message, key, spec):
            state.keeps_queue_lock = True
            raise SkipMessage("a copy of this message was handed the lock first")
        owner = f"{message.message_id}/{uuid.uuid4().hex[:12]}"
        taken_at = time.monotonic() * 1000
        try:
            got = self.backend.acquire(key, owner, ttl=self.settings.lease, limit=spec.lock_limit, lock=spec.lock.name)  # type: ignore[union-attr]
        except Exception as e:
            error = self.backend_error("take the run lock", key, spec, message, e)
            if self.settings.on_backend_error == "run_unlocked":
                self.logger.warning("Running %s without its lock %r.", message, key)
                return
            raise error from e
        if not got.acquired:
            self._on_run_conflict(broker, message, state, key, got.holder)
        state.run_key, state.run_owner, state.fence = key, owner, got.fence
        state.lease = self.leases.hold(key, owner, taken_at, actor=spec.actor_name)
        set_fence(got.fence)
        self.emit("locked", spec, key, message)

    def _claim(self, message: "MessageProxy", key: str, spec: ActorSpec) -> bool:
        attempt = message.options.get("unique_reschedules", 0)
        if not attempt:
            return True
        return self.backend.claim(key, f"{message.message_id}:{attempt}")  # type: ignore[union-attr]

    def _withdraw(self, key: str, ticket: str, spec: ActorSpec, message: "MessageProxy") -> None:
        """Take back a waiter whose delayed copy was never enqueued, so
        no hand-off runs it beside the retry of the original.
        """
        try:
            self.backend.claim(key, ticket)  # type: ignore[union-attr]
        except Exception as e:
            self.backend_error("withdraw the waiter of", key, spec, message, e)

    def _on_run_conflict(
        self, broker: "Broker", message: "MessageProxy", state: Delivery, key: str, holder: Optional[str]
    ) -> None:
        spec = state.spec
        strategy = spec.server
        holder_id = holder.split("/")[0] if holder else None
        if strategy == "reschedule":
            self._reschedule(broker, message, state, key)
        self.emit("conflict", spec, key, message, holder)
        if strategy == "raise":
            raise LockConflict(f"Run lock {key!r} is held by message {holder_id}.", key=key, holder=holder_id)
        if strategy == "reject":
            self.logger.warning("Dead-lettering %s: run lock %r is held by message %s.", message, key, holder_id)
            message.fail()
        else:
            self.logger.warning("Dropping %s: run lock %r is held by message %s.", message, key, holder_id)
        message.options["store_results"] = False
        raise SkipMessage(f"run lock {key!r} is held")

    def _reschedule(self, broker: "Broker", message: "MessageProxy", state: Delivery, key: str) -> None:
        spec = state.spec
        attempt = message.options.get("unique_reschedules", 0) + 1
        base = spec.reschedule_delay if spec.reschedule_delay is not None else self.settings.reschedule_delay
        copy = message.copy(options={"unique_reschedules": attempt, "unique_digest": state.digest})
        ticket = f"{message.message_id}:{attempt}"
        # Register before enqueueing: a delayed copy that arrived first
        # would find no ticket to claim, and the hand-off would run it again.
        try:
            order = int(message.message_timestamp)
            self.backend.wait(key, ticket, copy.encode(), order=order, ttl=self.settings.lock_ttl)  # type: ignore[union-attr]
        except Exception as e:
            self.emit("backend_error", spec, key, message)
            self.logger.warning("Could not register %s as waiting for %r (%r); it runs after its delay.", message, key, e)
        try:
            broker.enqueue(copy, delay=int(base * random.uniform(0.8, 1.2)))
        except Exception as e:
            self._withdraw(key, ticket, spec, message)
            raise self.backend_error("reschedule a message waiting for", key, spec, message, e) from e
        state.keeps_queue_lock = True
        message.options["store_results"] = False
        self.emit("rescheduled", spec, key, message)
        self.logger.debug("Rescheduled %s: run lock %r is held.", message, key)
        raise Rescheduled(f"run lock {key!r} is held; rescheduled")

    def after_process_message(
        self,
        broker: "Broker",
        message: "MessageProxy",
        *,
        result: Any = None,
        exception: Optional[BaseException] = None,
    ) -> None:
        state = delivery(message)
        if state is None:
            return
        self._end_run(broker, message, state)
        finished = exception is None or message.failed or not self._retries
        if finished and state.spec.lock.queue_release != "expiry":
            self._release_queue_lock(message, state)

    def after_skip_message(self, broker: "Broker", message: "MessageProxy") -> None:
        state = delivery(message) or self._late_state(message)
        if state is None:
            return
        self._end_run(broker, message, state)
        if not state.keeps_queue_lock and state.spec.lock.queue_release != "expiry":
            self._release_queue_lock(message, state)

    def after_nack(self, broker: "Broker", message: "MessageProxy") -> None:
        state = delivery(message) or self._late_state(message)
        if state is not None and state.spec.lock.queue_release != "expiry":
            self._release_queue_lock(message, state)

    def _late_state(self, message: "MessageProxy") -> Optional[Delivery]:
        """State for a message whose before-hook never ran (AgeLimit,
        actor lookups in the consumer).
        """
        spec = self.specs.get(message.actor_name)
        digest = message.options.get("unique_digest")
        if spec is None or digest is None or not self.enabled:
            return None
        return attach(message, Delivery(spec, digest))

    # Releasing --------------------------------------------------------

    def _release_queue_lock(self, message: "MessageProxy", state: Delivery, strict: bool = False) -> None:
        """Release the enqueue lock; ``strict`` raises on a backend
        failure so the delivery is retried instead of leaving the lock
        to block new sends until it expires.
        """
        if state.queue_released or not state.spec.lock.queue_lock:
            return
        key = self.key(state.spec, state.digest, "queue")
        try:
            released = self.backend.release(key, message.message_id)  # type: ignore[union-attr]
        except Exception as e:
            error = self.backend_error("release", key, state.spec, message, e)
            if strict:
                raise error from e
            return
        state.queue_released = True
        if released.held:
            self.emit("released", state.spec, key, message)
        else:
            self.logger.warning(
                "Lock %r of message %s lapsed before it was released: raise its lock_ttl.", key, message.message_id
            )
            self.emit("lock_lost", state.spec, key, message)

    def _end_run(self, broker: "Broker", message: "MessageProxy", state: Delivery) -> None:
        if state.run_key is None or state.run_owner is None:
            return
        key, owner, lease = state.run_key, state.run_owner, state.lease
        state.run_key = state.run_owner = state.lease = None
        set_fence(None)
        if lease is not None:
            self.leases.drop(lease)
        try:
            released = self.backend.release(key, owner)  # type: ignore[union-attr]
        except Exception as e:
            self.backend_error("release", key, state.spec, message, e)
            return
        if released.held:
            self.emit("released", state.spec, key, message)
        elif lease is None or not lease.lost:
            self._report_lost(state.spec.actor_name, key, owner)
        if released.promoted is not None:
            self._promote(broker, state.spec, key, released.promoted)

    def _promote(self, broker: "Broker", spec: ActorSpec, key: str, encoded: bytes) -> None:
        from dramatiq import Message

        try:
            broker.enqueue(Message.decode(encoded))
        except Exception as e:
            self.logger.warning("Could not hand %r to its next waiter (%r); it runs after its delay.", key, e)

    def _lease_lost(self, lease: Lease) -> None:
        self._report_lost(lease.actor, lease.key, lease.owner)

    def _renewal_failed(self, lease: Lease) -> None:
        self.events.emit(LockEvent("backend_error", lease.actor, lease.key, lease.owner.split("/")[0]))

    def _report_lost(self, actor: str, key: str, owner: str) -> None:
        self.logger.error(
            "Lock %r was lost: message %s no longer holds it (its lease expired or it was taken over).",
            key,
            owner.split("/")[0],
        )
        self.events.emit(LockEvent("lock_lost", actor, key, owner.split("/")[0]))



def digest_for(actor: "Actor[Any, Any]", *args: Any, **kwargs: Any) -> str:
    """The digest that ``actor.send(*args, **kwargs)`` would lock.

    Raises:
      ConfigurationError: when the actor takes no lock, or the
        arguments give no valid key.
    """
    for middleware in actor.broker.middleware:
        if isinstance(middleware, UniqueMiddleware) and actor.actor_name in middleware.specs:
            return middleware.specs[actor.actor_name].digest(args, kwargs)
    raise ConfigurationError(f"Actor {actor.actor_name!r} takes no lock from a UniqueMiddleware on its broker.")
