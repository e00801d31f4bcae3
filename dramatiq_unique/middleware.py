"""The ``UniqueMiddleware``: where each lock is taken and released.

* Enqueue locks are owned by the message id, so Retries, delay-queue promotion, RabbitMQ publish
  retries and our own reschedule re-enter them; those paths never raise.
* At worker boot it moves itself before ``TimeLimit``: its after-hooks run after Retries has
  decided, and no time limit interrupts them.
* Anything unexpected in ``before_process_message`` becomes a ``MiddlewareError``: the delivery is
  retried, and the actor never runs without its lock.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

from dramatiq.logging import get_logger
from dramatiq.middleware import (
    AgeLimit,
    Callbacks,
    Middleware,
    MiddlewareError,
    Pipelines,
    Retries,
    ShutdownNotifications,
    TimeLimit,
)

from . import settings as config
from .backends import for_broker, from_url
from .backends.base import LockBackend
from .backends.capabilities import BatchedReleases, NewestWins, Reschedules
from .backends.records import Start
from .background import now_ms, stop_calls_by
from .compat import Prometheus, proxied_message
from .errors import ConfigurationError
from .events import EventHub, Listener
from .model.spec import ACTOR_OPTIONS, ActorSpec, actor_spec
from .model.wire import UNIQUE_DIGEST
from .send.context import EnqueueLocks, LockContext, is_fresh
from .send.guard import EnqueueGuard
from .worker.leases import Delivery, HandoffPolls, LeaseKeeper, attach, delivery, track
from .worker.reap import PeriodicReaper, check_backend, start_reaper
from .worker.release import LockTroubles, Releaser, Reports, Unlocker
from .worker.resend import RUN_SUFFIX, FailedReleases, OwedRelease, OwedReleases
from .worker.take import RunLockTaker
from .worker.take import install as quiet_our_skips

if TYPE_CHECKING:
    from dramatiq import Actor, Broker, Worker
    from dramatiq.broker import MessageProxy

#: Middleware that must come after ours: their after-hooks run first, their interrupts miss our hooks,
#: and a copy we skip never reaches them (AgeLimit would dead-letter both copies of an expired message).
_RUN_AFTER = (AgeLimit, TimeLimit, ShutdownNotifications, Callbacks, Pipelines, Retries)

#: The end of ``shutdown_timeout`` (at most ``_SHUTDOWN_RESERVE_MOST`` ms) kept to write unsent releases to
#: the broker; lock calls end before it.  A worker whose lock Redis is out of reach thus stops about
#: ``shutdown_timeout - reserve`` in, leaving Dramatiq's own ~2 s stop within the bound.
_SHUTDOWN_RESERVE = 0.3
_SHUTDOWN_RESERVE_MOST = 3_000

#: Guards the lazy creation of the threads: worker threads ask at once.
_MAKING = threading.Lock()

#: Middleware that must come before ours: it counts a delivery in its before-hook and uncounts it in
#: ``after_skip_message``, so it must see the deliveries we skip.
_RUN_BEFORE = (Prometheus,)


class _OnService:
    """A middleware setting kept on its :class:`LockContext`, where the guards read it: changes apply at once."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, middleware: Any, owner: Optional[type] = None) -> Any:
        if middleware is None:  # read on the class (help(), autodoc, inspect): the descriptor itself
            return self
        return getattr(middleware.service, self.name)

    def __set__(self, middleware: Any, value: Any) -> None:
        setattr(middleware.service, self.name, value)


class UniqueMiddleware(Middleware):
    """Locks messages by a digest of their actor, queue and arguments.

    Durations are in milliseconds.  Every argument left as None is read from its ``dramatiq_unique_*``
    environment variable, or takes its ``DEFAULT_*`` value.

    Parameters:
      backend(LockBackend): Where locks live.  Defaults to the backend that ``url`` names, else the
        broker's own Redis, else a ``StubBackend`` for a ``StubBroker``.
      url(str): ``redis://``, ``rediss://``, ``unix://``, ``redis+cluster://`` (a ``RedisBackend``),
        ``postgresql://`` or ``postgres://`` (a ``PostgresBackend``); see
        :func:`dramatiq_unique.backends.from_url`.
      redis_url(str): Another name for ``url``.
      lock_ttl(int): Default lifetime of enqueue locks, counted from when the message is due.
      enabled(bool): False turns all locking off.
      on_backend_error(str): ``"fail"`` never runs or enqueues a message without its lock;
        ``"run_unlocked"`` carries on without it.
      provisional_window(int): How long a new enqueue lock holds before its publish is confirmed, so
        that a producer dying in between frees its key; 0 takes ``lock_ttl`` at once.
      reap_interval(int): How often one worker releases the enqueue locks whose message vanished from
        the Redis broker; 0 (the default) never.
      record_lock_args(bool): Store the lock args JSON with each enqueue lock, for operators.
      min_replicas(int): How many replicas must acknowledge each lock taken (Redis ``WAIT``), for a
        backend made here (a ``backend`` passed in takes its own); 0 (the default) none.
      min_replicas_timeout(int): How long each lock call waits for them.
      shutdown_timeout(int): How long a worker's shutdown waits for lock calls, releases and
        confirmations; what it could not send is written to the broker for the next worker.
      listeners(list[callable]): Called with every :class:`LockEvent`, like
        ``middleware.events.subscribe(listener)``.

    Warning:
      Like every lease-based lock, this one is best effort under process pauses and Redis failover.
      Guard writes that must never overlap with :func:`dramatiq_unique.fence_token`.
    """

    def __init__(
        self,
        *,
        backend: Optional[LockBackend] = None,
        url: Optional[str] = None,
        redis_url: Optional[str] = None,
        prefix: Optional[str] = None,
        lock_ttl: Optional[int] = None,
        lease: Optional[int] = None,
        reschedule_delay: Optional[int] = None,
        enabled: Optional[bool] = None,
        on_backend_error: Optional[str] = None,
        provisional_window: Optional[int] = None,
        reap_interval: Optional[int] = None,
        record_lock_args: Optional[bool] = None,
        min_replicas: Optional[int] = None,
        min_replicas_timeout: Optional[int] = None,
        shutdown_timeout: Optional[int] = None,
        listeners: Iterable[Listener] = (),
    ) -> None:
        self.logger = get_logger(__name__, type(self))
        self.settings = config.from_environment().merge(
            url=url,
            redis_url=redis_url,
            prefix=prefix,
            lock_ttl=lock_ttl,
            lease=lease,
            reschedule_delay=reschedule_delay,
            enabled=enabled,
            on_backend_error=on_backend_error,
            provisional_window=provisional_window,
            reap_interval=reap_interval,
            record_lock_args=record_lock_args,
            min_replicas=min_replicas,
            min_replicas_timeout=min_replicas_timeout,
            shutdown_timeout=shutdown_timeout,
        )
        if backend is not None and not isinstance(backend, LockBackend):
            raise ConfigurationError(
                f"backend={backend!r} is invalid: expected a LockBackend, e.g. from_url('redis://...')."
            )
        self.events = EventHub()
        for listener in listeners:
            self.events.subscribe(listener)
        self.specs: dict[str, ActorSpec] = {}
        self.service = LockContext(settings=self.settings, logger=self.logger, events=self.events, specs=self.specs)
        #: Async actors with a run lock, whose coroutines are tracked.
        self.async_actors: set[str] = set()
        troubles = LockTroubles(self.service)
        self.unlocker = Unlocker(self.service, troubles=troubles)
        #: The worker's background tasks, which report releases to the unlocker.
        self.threads = self.unlocker.threads = WorkerThreads(self.service, reports=self.unlocker, troubles=troubles)
        self.taker = RunLockTaker(self.service, self.unlocker, async_actors=self.async_actors)
        if backend is None and self.settings.url is not None:
            backend = from_url(self.settings.url, **self._backend_options())
        self.backend = backend
        self._locks = EnqueueLocks(self.service)
        self._guard = EnqueueGuard(self._locks, middleware=self)
        self._retries = True
        self.owed = OwedReleases(self.service)
        self._stop_by: Optional[float] = None

    @property
    def actor_options(self) -> set[str]:
        return set(ACTOR_OPTIONS)

    # Set-up ---------------------------------------------------------

    def _backend_options(self) -> dict[str, Any]:
        """The replicas to wait for, only when asked: a backend without them refuses the options."""
        settings = self.settings
        if not settings.min_replicas:
            return {}
        return {"min_replicas": settings.min_replicas, "min_replicas_timeout": settings.min_replicas_timeout}

    def attach(self, broker: "Broker") -> None:
        """Pick the backend for ``broker`` if none was given, and guard its ``enqueue``; idempotent."""
        if self.backend is None:
            backend = for_broker(broker, **self._backend_options())
            if backend is None:
                raise ConfigurationError(
                    f"UniqueMiddleware has no lock backend for a {type(broker).__name__}. Set the "
                    "dramatiq_unique_url environment variable (a redis:// or postgresql:// URL), or pass url=... "
                    "or backend=... to UniqueMiddleware."
                )
            self.backend = backend
        self._guard.install(broker)

    @staticmethod
    def _check_capabilities(spec: ActorSpec, backend: LockBackend) -> None:
        """Refuse (``MissingCapability``) an actor whose options need a capability ``backend`` lacks."""
        actor = f"actor {spec.actor_name!r}"
        if spec.server == "reschedule":
            feature = f"{actor}, with on_conflict='reschedule' (the server side's default),"
            Reschedules.require(backend, feature=feature)
        if spec.client == "replace":
            option = "debounce" if spec.debounce is not None else "on_conflict='replace'"
            NewestWins.require(backend, feature=f"{actor}, with {option},")

    @property
    def backend(self) -> Optional[LockBackend]:
        """Where the locks live; None until a broker picks the default."""
        return self.service.backend

    @backend.setter
    def backend(self, backend: Optional[LockBackend]) -> None:
        for spec in self.specs.values():  # before anything stops: a refused backend changes nothing
            if backend is not None:
                self._check_capabilities(spec, backend)
        # Leases renew on the backend that holds them: start afresh.
        self.threads.restart()
        self.service.backend = backend

    # What each does: see the class docstring.
    enabled = _OnService()
    record_lock_args = _OnService()

    def flush_confirmations(self, timeout: float = 5.0) -> bool:
        """Wait at most ``timeout`` seconds until every provisional enqueue lock of this process is
        confirmed (done at exit too); True when none is left waiting.
        """
        return self._locks.flush(timeout)

    def key(self, spec: ActorSpec, digest: str, phase: str) -> str:
        """The backend key of one lock: prefix, actor in clear text, digest inside a Cluster hash tag."""
        return self.service.key(spec, digest, phase)

    # Declaration and boot ---------------------------------------------

    def before_declare_actor(self, broker: "Broker", actor: "Actor[Any, Any]") -> None:
        spec = actor_spec(actor)
        if spec is not None:
            self.attach(broker)
            assert self.backend is not None
            self._check_capabilities(spec, self.backend)
            self.specs[actor.actor_name] = spec
            if spec.lock.run_lock and track(actor):
                self.async_actors.add(actor.actor_name)

    def before_worker_boot(self, broker: "Broker", worker: "Worker") -> None:
        self._retries = any(isinstance(m, Retries) for m in broker.middleware)
        # Every actor is declared by now: with none locked, leave the stack and the loggers alone.
        if self.specs:
            self.attach(broker)
            self._move_before_interrupters(broker, worker)
            quiet_our_skips()
            if self.enabled and self.backend is not None:  # says so now if it does not answer
                settings = self.settings
                check_backend(
                    self.backend, prefix=settings.prefix, on_backend_error=settings.on_backend_error, logger=self.logger
                )
            self._declare_owed(broker, worker)
        self.threads.start_reaper(broker)

    def _declare_owed(self, broker: "Broker", worker: Optional["Worker"]) -> None:
        """Declare the actor of owed releases on a queue this worker consumes, as will its successor."""
        consumed = getattr(worker, "consumer_whitelist", None)
        for name in self.specs:
            queue = broker.get_actor(name).queue_name
            if not consumed or queue in consumed:
                self.owed.declare(broker, queue)
                return

    def _move_before_interrupters(self, broker: "Broker", worker: "Worker") -> None:
        # Called while emit_before iterates over the stack: a new list lets that iteration visit each
        # middleware exactly once (AsyncIO's boot hook starts a thread: twice would start two).
        stack = list(broker.middleware)
        targets = [i for i, m in enumerate(stack) if isinstance(m, _RUN_AFTER)]
        here = stack.index(self)
        if targets and min(targets) < here:
            stack.insert(min(targets), stack.pop(here))
            self.logger.debug("Moved UniqueMiddleware before %s.", type(stack[min(targets) + 1]).__name__)
        for late in [m for m in stack[stack.index(self) + 1 :] if isinstance(m, _RUN_BEFORE)]:
            stack.insert(stack.index(self), stack.pop(stack.index(late)))
            self.logger.debug("Moved %s before UniqueMiddleware.", type(late).__name__)
        if stack != broker.middleware:
            broker.middleware = stack

    def after_consumer_thread_boot(self, broker: "Broker", thread: Any) -> None:
        self.threads.handoffs.consumer_booted(thread)

    def _shutdown_reserve(self) -> float:
        return min(self.settings.shutdown_timeout * _SHUTDOWN_RESERVE, _SHUTDOWN_RESERVE_MOST)

    def before_worker_shutdown(self, broker: "Broker", worker: "Worker") -> None:
        # The bound starts now; no wait for a lock call of this process lasts past the reserve.
        self._stop_by = now_ms() + self.settings.shutdown_timeout
        stop_calls_by(self._stop_by - self._shutdown_reserve())

    def after_worker_shutdown(self, broker: "Broker", worker: "Worker") -> None:
        """Stop the background tasks within ``shutdown_timeout``; write unsent releases to the broker."""
        stop_by = self._stop_by if self._stop_by is not None else now_ms() + self.settings.shutdown_timeout
        calls_by = stop_by - self._shutdown_reserve()

        def left() -> float:
            return max(calls_by - now_ms(), 0.0)

        try:
            owed = self.threads.stop(left)
            self.flush_confirmations(left() / 1000)
            self.owed.write(owed, timeout=max(stop_by - now_ms(), self._shutdown_reserve()))
        finally:
            self._stop_by = None
            stop_calls_by(None)

    # Enqueue --------------------------------------------------------

    def before_enqueue(self, broker: "Broker", message: Any, delay: Optional[int]) -> None:
        spec = self.specs.get(message.actor_name)
        if spec is None or not self.enabled:
            return
        fresh = is_fresh(message)
        try:
            self._locks.stamp(message, spec, fresh)
            if spec.lock.queue_lock:
                self._guard.take(message, delay, spec, fresh=fresh, broker=broker)
        except MiddlewareError:
            if fresh:
                raise
            # Raising from a re-enqueue (a retry, a delay-queue move) loses the message: go on, like a lapsed lock.
            self.logger.error("Enqueueing %s without its lock: it could not be re-entered.", message, exc_info=True)
        except Exception as e:
            # Dramatiq would log this and enqueue a new message unlocked.
            error = self.service.backend_error("lock", message.options.get(UNIQUE_DIGEST, "?"), spec, message, e)
            if fresh:
                message.options.pop(UNIQUE_DIGEST, None)
                raise error from e

    # Processing -----------------------------------------------------

    def before_process_message(self, broker: "Broker", message: "MessageProxy") -> None:
        # The proxy forwards every read through a Python-level __getattr__: read the message itself.
        raw: Any = proxied_message(message)
        spec = self.specs.get(raw.actor_name)
        if spec is None or not self.enabled:
            return
        try:
            self.taker.take(broker, message, raw, spec)
        except MiddlewareError:
            raise
        except Exception as e:
            raise self.service.backend_error("lock", message.options.get(UNIQUE_DIGEST, "?"), spec, message, e) from e

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
        # Retries, after us in the stack, has decided: a run that raised never finishes its message.
        self.unlocker.end_run(broker, message, state, succeeded=exception is None)
        if exception is None or message.failed or not self._retries:
            self.unlocker.release_queue_lock(message, state)

    def after_skip_message(self, broker: "Broker", message: "MessageProxy") -> None:
        state = delivery(message) or self._late_state(message)
        if state is None:
            return
        self.unlocker.end_run(broker, message, state, succeeded=not message.failed)
        if not state.keeps_queue_lock:
            self.unlocker.release_queue_lock(message, state)

    def after_nack(self, broker: "Broker", message: "MessageProxy") -> None:
        state = delivery(message) or self._late_state(message)
        if state is not None:
            self.taker.retire(message, state)
            self.unlocker.release_queue_lock(message, state)

    def _late_state(self, message: "MessageProxy") -> Optional[Delivery]:
        """State for a message whose before-hook never ran (AgeLimit, actor lookups in the consumer)."""
        spec = self.specs.get(message.actor_name)
        digest = message.options.get(UNIQUE_DIGEST)
        if spec is None or digest is None or not self.enabled:
            return None
        return attach(message, Delivery(spec, digest))


def digest_for(actor: "Actor[Any, Any]", *args: Any, **kwargs: Any) -> str:
    """The digest that ``actor.send(*args, **kwargs)`` would lock.

    Raises:
      ConfigurationError: when the actor takes no lock, or the arguments give no valid key.
    """
    for middleware in actor.broker.middleware:
        if isinstance(middleware, UniqueMiddleware) and actor.actor_name in middleware.specs:
            return middleware.specs[actor.actor_name].digest(args, kwargs)
    raise ConfigurationError(f"Actor {actor.actor_name!r} takes no lock from a UniqueMiddleware on its broker.")


class WorkerThreads:
    """The background tasks of one middleware in a worker process.

    Each is made on first use, on the current backend; a new backend stops the lock threads.  ``reports``
    hears the outcome of releases, ``troubles`` lost leases and stalled releases.
    """

    def __init__(self, service: LockContext, *, reports: Reports, troubles: LockTroubles) -> None:
        self.service = service
        self.reports = reports
        self.troubles = troubles
        self.handoffs = HandoffPolls()
        self._leases: Optional[LeaseKeeper] = None
        self._releaser: Optional[Releaser] = None
        self._failed: Optional[FailedReleases] = None
        self._reaper: Optional[PeriodicReaper] = None

    @property
    def leases(self) -> LeaseKeeper:
        """Renews the run leases of this process."""
        if self._leases is None:
            # Worker threads ask at once: a lease held by a second keeper would be renewed after its release.
            with _MAKING:
                if self._leases is None:
                    self._leases = LeaseKeeper(
                        self.service.locks,
                        lease=self.service.settings.lease,
                        on_lost=self.troubles.lease_lost,
                        on_error=self.troubles.renewal_failed,
                    )
        return self._leases

    @property
    def releaser(self) -> Optional[Releaser]:
        """Releases run locks off the worker thread; None unless the backend batches releases."""
        backend = self.service.backend
        if self._releaser is None and isinstance(backend, BatchedReleases) and backend.batches_releases:
            with _MAKING:  # worker threads ask at once: make one
                if self._releaser is None:
                    self._releaser = Releaser(backend, reports=self.reports, on_stalled=self.troubles.releases_stalled)
        return self._releaser

    @property
    def take_run_lock(self) -> Callable[..., Start]:
        """The take of a run lock: the releaser's (pending releases ride in its round trip), else the backend's."""
        releaser = self.releaser
        return releaser.take_run_lock if releaser is not None else self.service.locks.start

    @property
    def failed(self) -> FailedReleases:
        """Sends the releases that failed again, off the worker thread."""
        if self._failed is None:
            with _MAKING:
                if self._failed is None:
                    ttl = self.service.settings.lock_ttl
                    self._failed = FailedReleases(self.service.locks, reports=self.reports, record_ttl=ttl)
        return self._failed

    def start_reaper(self, broker: "Broker") -> None:
        """Start the periodic reaper, once, if ``reap_interval`` asks for one."""
        if self._reaper is None:
            self._reaper = start_reaper(self.service, broker)

    def restart(self) -> None:
        """Stop the lock threads: the next use makes each on the backend current then."""
        threads = (self._leases, self._releaser, self._failed)
        self._leases = self._releaser = self._failed = None
        for thread in threads:
            if thread is not None:
                thread.stop()

    def stop(self, left: Callable[[], float]) -> list[OwedRelease]:
        """Stop every thread within ``left()`` ms; return the releases not sent, for the next worker."""
        self.handoffs.stop()
        owed: list[OwedRelease] = []
        if self._releaser is not None:
            owed += [self._owed(p.key, p.owner, now_ms(), p.options) for p in self._releaser.stop(left())]
        if self._failed is not None:
            # After the releaser, whose failures it takes.
            owed += [self._owed(f.key, f.owner, f.until, f.options) for f in self._failed.stop(left())]
        if self._leases is not None:
            self._leases.stop(timeout=left())
        if self._reaper is not None:
            self._reaper.stop(timeout=left())
            self._reaper = None
        return owed

    def _owed(self, key: str, owner: str, until: float, options: dict[str, Any]) -> OwedRelease:
        """A release to hand on, from its lock's monotonic expiry.  A run lock's outlives its lease: it
        also ends the run in a rescheduled message's record (which lives ``lock_ttl``), skipping duplicates.
        """
        if key.endswith(RUN_SUFFIX):
            until = max(until, now_ms() + self.service.settings.lock_ttl)
        return OwedRelease.within(key, owner, until - now_ms(), options)
