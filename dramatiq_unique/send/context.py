"""The lock context, the guarded enqueue call, what a send stamps on a message, and what a caller
waiting on a result learns.  A delivery runs no other send module.

Guards, replace, debounce and the fast path act for one middleware through a :class:`LockContext`,
never the middleware itself.  Imports go downwards only (guard -> fastpath -> this -> confirm; the
worker side imports the send side); ``tests/test_import_graph.py`` fails on any cycle.

A message we drop, dead-letter or supersede gives its caller a ``ResultFailure`` naming why, and a
copy skipped while another runs stores nothing: Dramatiq's ``Results`` would store ``None`` for both.
"""

from __future__ import annotations

import functools
import logging
import threading
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional

from dramatiq.logging import get_logger

from ..backends.capabilities import NewestWins
from ..backends.records import SENDS_PER_MS, Copy
from ..compat import ConsumerThread, replace_broker_enqueue, result_options
from ..errors import DuplicateMessage, LockBackendError
from ..events import EventHub, LockEvent
from ..model.wire import (
    UNIQUE_DIGEST,
    UNIQUE_DUPLICATE_OF,
    UNIQUE_LOCK_ARGS,
    UNIQUE_RESCHEDULES,
    UNIQUE_SEQ,
    UNIQUE_VIA,
    join_place,
    lock_key,
    message_id_of,
)
from .confirm import Confirmer, Pending

if TYPE_CHECKING:
    from dramatiq import Broker

    from ..backends.base import LockBackend
    from ..model.spec import ActorSpec
    from ..settings import Settings


#: A slot handed to a waiter stays reserved this many reschedule delays (the longest its delayed copy
#: takes to come if the hand-off copy is lost), plus RESERVE_SLACK ms.
RESERVE_DELAYS = 2
RESERVE_SLACK = 1_000


class LockContext:
    """The backend of one middleware, and how its guards report.

    ``specs`` holds the locked actors by name: the middleware's own dict, filled as actors are declared.
    """

    def __init__(
        self, *, settings: "Settings", logger: logging.Logger, events: EventHub, specs: dict[str, "ActorSpec"]
    ) -> None:
        self.settings = settings
        self.logger = logger
        self.events = events
        self.specs = specs
        #: None until a broker picks the default.
        self.backend: Optional["LockBackend"] = None
        self.enabled = settings.enabled
        self.record_lock_args = settings.record_lock_args

    @property
    def locks(self) -> "LockBackend":
        """The backend, once picked.  Reach a capability's verbs with ``Capability.require(service.locks, ...)``:
        the middleware checked it when declaring each actor that needs it.
        """
        backend = self.backend
        assert backend is not None
        return backend

    def reschedule_delay(self, spec: "ActorSpec") -> int:
        """The delay of a rescheduled copy of ``spec``'s messages, in ms."""
        return spec.reschedule_delay if spec.reschedule_delay is not None else self.settings.reschedule_delay

    def reserve(self, spec: "ActorSpec") -> int:
        """How long, in ms, a slot handed to a waiter stays reserved (see :data:`RESERVE_DELAYS`)."""
        return RESERVE_DELAYS * self.reschedule_delay(spec) + RESERVE_SLACK

    def key(self, spec: "ActorSpec", digest: str, phase: str) -> str:
        """The backend key of one lock: prefix, actor in clear text, digest inside a Cluster hash tag."""
        return lock_key(prefix=self.settings.prefix, scope=spec.scope, digest=digest, phase=phase)

    def emit(
        self,
        name: str,
        spec: "ActorSpec",
        key: str,
        message: Any,
        holder: Optional[str] = None,
        *,
        reason: Optional[str] = None,
    ) -> None:
        """Count a lock event and pass it to the listeners."""
        listeners = self.events.tally(name, spec.actor_name)
        if listeners:  # two events a job: built only for someone
            message_id = getattr(message, "message_id", None)
            if reason is None:
                event = LockEvent(name, spec.actor_name, key, message_id, message_id_of(holder))
            else:  # a skipped copy names its reason, and the run it duplicates as a whole owner
                event = LockEvent(name, spec.actor_name, key, message_id, holder, reason)
            self.events.tell(listeners, event)

    def backend_error(
        self, action: str, key: str, spec: "ActorSpec", message: Any, error: Exception
    ) -> LockBackendError:
        """Log and count a backend failure, and wrap it."""
        assert self.backend is not None
        self.emit("backend_error", spec, key, message)
        where = self.backend.describe()
        self.logger.error("Lock backend %s failed to %s %r: %r", where, action, key, error)
        return LockBackendError(f"Lock backend {where} failed to {action} {key!r}: {error!r}", backend=where)

    def enqueue_ttl(self, spec: "ActorSpec", delay: Optional[int]) -> int:
        """An enqueue lock's lifetime: ``lock_ttl`` from when the message is due."""
        return (delay or 0) + self.queue_lock_ttl(spec)

    def queue_lock_ttl(self, spec: "ActorSpec") -> int:
        return spec.lock_ttl if spec.lock_ttl is not None else self.settings.lock_ttl


class Deferred(NamedTuple):
    """An enqueue lock noted in ``before_enqueue``, for the fast path to take in ``do_enqueue``."""

    key: str
    ttl: int
    lock_args: Optional[str]
    where: str
    spec: "ActorSpec"
    message: Any


class GuardedCall:
    """What the current guarded enqueue call did to locks."""

    __slots__ = ("taken", "provisional", "deferred")

    def __init__(self) -> None:
        #: Locks taken fresh: released if the publish fails.
        self.taken: list[tuple[str, str]] = []
        #: Provisional locks: confirmed once the publish returns.
        self.provisional: list[Pending] = []
        #: Locks the fast path takes with the publish, by ``redis_message_id`` (a hook may enqueue another).
        self.deferred: Optional[dict[str, Deferred]] = None


#: The guarded enqueue call under way in this context, if any.
CURRENT_CALL: ContextVar[Optional[GuardedCall]] = ContextVar("dramatiq_unique_taken", default=None)


class Refused(DuplicateMessage):
    """A duplicate under ``on_conflict="log"``: the guarded enqueue returns it unsent."""


def maybe_applied(error: Exception) -> bool:
    """Whether a failed call may have taken effect: a timeout may have lost only its reply."""
    return "timeout" in type(error).__name__.lower()


def is_fresh(message: Any) -> bool:
    """Whether this is a new send, which may be refused, not a re-enqueue, which must never raise."""
    return UNIQUE_DIGEST not in message.options and not isinstance(threading.current_thread(), ConsumerThread)


class EnqueueLocks:
    """What every path that takes an enqueue lock shares, and the guarded enqueue call they run in.

    Dramatiq 2.x gives middleware no way to cancel an enqueue, so :meth:`guard` wraps the broker's
    ``enqueue``: a refused duplicate is returned unsent, a failed publish gives back what its call
    took, and provisional locks go to the :class:`~.confirm.Confirmer` once the publish returned.
    """

    def __init__(self, service: LockContext) -> None:
        self.service = service
        #: The Redis broker's namespace, to record for the reaper where each message goes; else None.
        self.namespace: Optional[str] = None
        self._confirmer: Optional[Confirmer] = None
        self._confirmer_mutex = threading.Lock()

    def guard(self, broker: "Broker") -> None:
        """Wrap ``broker.enqueue``, once."""
        if getattr(broker.enqueue, "_unique_guard", None) is self:
            return
        namespace = getattr(broker, "namespace", None)
        self.namespace = namespace if isinstance(namespace, str) else None
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

    def stamp(self, message: Any, spec: "ActorSpec", fresh: bool) -> None:
        """Stamp the digest on a new message; with a run lock, also its send order and the lock args
        (the run lock records them from the message).  A message with a digest is being re-enqueued
        (retry, delay-queue move, reschedule, publish retry) and keeps its stamps.
        """
        if UNIQUE_DIGEST not in message.options:
            message.options[UNIQUE_DIGEST] = spec.digest(message.args, message.kwargs)
            if spec.lock.run_lock:
                send_sequence.stamp(message)
        if spec.lock.run_lock:
            recorded = self.lock_args(message, spec, fresh)
            if recorded is not None:
                message.options.setdefault(UNIQUE_LOCK_ARGS, recorded)

    def debounce_delay(self, message: Any, delay: Optional[int]) -> Optional[int]:
        """For a new debounced send, at least its quiet window, so that the broker puts it on the delay
        queue; ``before_enqueue`` then sets its due time.
        """
        service = self.service
        spec = service.specs.get(message.actor_name)
        if spec is None or spec.debounce is None or not service.enabled or not is_fresh(message):
            return delay
        return max(delay or 0, spec.debounce)

    @property
    def newest_wins(self) -> NewestWins:
        return NewestWins.require(self.service.locks, feature="on_conflict='replace'")

    def _restore(self, message: Any, taken: list[tuple[str, str]]) -> None:
        """After a failed publish, make the message this send superseded current again, so it runs (the
        guard then releases this send's slot); on a backend failure it stays superseded, as the error says.
        """
        service = self.service
        spec = service.specs.get(message.actor_name)
        if spec is None or spec.client != "replace":
            return
        for key, owner in taken:
            try:
                previous = self.newest_wins.unreplace(key, owner)
            except Exception as e:
                service.backend_error("restore the message superseded by an unsent one in", key, spec, message, e)
                continue
            if previous is not None:
                service.logger.info(
                    "Message %s is current again in %r: its replacement was not enqueued.", previous, key
                )

    def _release_all(self, taken: list[tuple[str, str]], actor: str) -> None:
        service = self.service
        for key, owner in taken:
            try:
                service.locks.release(key, owner)
                service.logger.info("Released %r: its message was not enqueued.", key)
                service.events.emit(LockEvent("released", actor, key, owner))
            except Exception as e:
                service.logger.error("Could not release %r after a failed enqueue: %r", key, e)
                service.events.emit(LockEvent("backend_error", actor, key, owner))

    @property
    def confirmer(self) -> Confirmer:
        backend = self.service.locks
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
        """Wait at most ``timeout`` seconds for this process's provisional locks to be confirmed."""
        return self._confirmer is None or self._confirmer.flush(timeout)

    def where(self, message: Any) -> str:
        """Where ``message`` is published, for the reaper: ``namespace\tqueue\tredis_message_id``; on other
        brokers only the queue (a RabbitMQ message cannot be looked up by id).
        """
        redis_id = message.options.get("redis_message_id")
        if self.namespace is None or not isinstance(redis_id, str):
            return join_place("", message.queue_name, "")
        return join_place(self.namespace, message.queue_name, redis_id)

    def lock_args(self, message: Any, spec: "ActorSpec", fresh: bool) -> Optional[str]:
        """The lock args JSON a new send records, if recorded: the stamped one, else worked out."""
        if not (fresh and self.service.record_lock_args):
            return None
        stamped = message.options.get(UNIQUE_LOCK_ARGS)
        if isinstance(stamped, str):
            return stamped
        return spec.canonical(spec.key_material(message.args, message.kwargs))

    def record(self, key: str, owner: str) -> None:
        """Remember a lock this call took, to give back if the message is not enqueued after all."""
        call = CURRENT_CALL.get()
        if call is not None:
            call.taken.append((key, owner))

    def locked(self, message: Any, spec: "ActorSpec", key: str) -> None:
        self.record(key, message.message_id)
        self.service.emit("locked", spec, key, message)

    def refuse(self, message: Any, spec: "ActorSpec", key: str, holder: Optional[str]) -> None:
        """Refuse a duplicate: raise to the caller under ``raise``, else :class:`Refused` (returned unsent)."""
        service = self.service
        message.options.pop(UNIQUE_DIGEST, None)
        service.emit("duplicate", spec, key, message, holder)
        text = f"Not enqueued: {message} duplicates message {holder}, which holds lock {key!r}."
        if spec.client == "raise":
            raise DuplicateMessage(text, key=key, holder=holder)
        service.logger.info("Duplicate %s not enqueued: lock %r is held by message %s.", message, key, holder)
        raise Refused(text, key=key, holder=holder)

    def lapsed(self, message: Any, spec: "ActorSpec", key: str, holder: Optional[str]) -> None:
        """A re-enqueue found its lock lapsed and held by ``holder``: it goes on unlocked, and says so."""
        self.service.logger.warning(
            "Lock %r of %s lapsed and is held by %s; enqueueing it anyway.", key, message, holder
        )
        self.service.emit("lock_lost", spec, key, message, holder)

    def take_failed(
        self, message: Any, spec: "ActorSpec", key: str, fresh: bool, error: Exception, *, give_back: bool = True
    ) -> None:
        """Taking the enqueue lock failed: a new send fails closed (unless told to run unlocked); a
        re-enqueue goes on.  ``give_back``: failing closed, give back a lock the call may have taken
        (false when the same call also published the message).
        """
        service = self.service
        wrapped = service.backend_error("take the enqueue lock", key, spec, message, error)
        if fresh and service.settings.on_backend_error == "fail":
            message.options.pop(UNIQUE_DIGEST, None)
            if give_back and maybe_applied(error):
                # Only the reply may be lost: give back what it holds (and what a replace superseded).
                self.record(key, message.message_id)
            raise wrapped from error
        service.logger.warning("Enqueueing %s without its lock %r.", message, key)


# What a send stamps, and the copy a delivery is ---------------------------


class _SendOrder:
    """Each send's place among this process's sends of its millisecond: waiters get a key in send
    order, and message ids, the only other tie-breaker, are random.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ms, self._next = -1, 0

    def stamp(self, message: Any) -> None:
        """Stamp ``unique_seq`` on a new message (a retry or a move keeps its place)."""
        ms = int(message.message_timestamp)
        with self._lock:
            if ms != self._ms:
                self._ms, self._next = ms, 0
            seq, self._next = self._next, self._next + 1
        message.options[UNIQUE_SEQ] = min(seq, SENDS_PER_MS - 1)


#: Stamps the send order of this process's new messages.
send_sequence = _SendOrder()


def send_order(message: Any) -> int:
    """A waiter's place: the millisecond its message was made, then its place within that millisecond."""
    return int(message.message_timestamp) * SENDS_PER_MS + int(message.options.get(UNIQUE_SEQ, 0))


def copy_of(message: Any, key: str) -> Copy:
    """Which copy of its message ``message`` is, for the run lock ``key``."""
    options = message.options
    # Built in C (every job makes one): a named tuple's own constructor runs Python.
    fields = (
        key,
        message.message_id,
        options.get(UNIQUE_RESCHEDULES, 0),
        options.get(UNIQUE_VIA, ""),
        options.get(UNIQUE_LOCK_ARGS),  # stamped at send under record_lock_args only
        options.get("retries", 0),
    )
    return tuple.__new__(Copy, fields)


# What a caller waiting on a result learns ---------------------------------

logger = get_logger(__name__)


def store_nothing(message: Any) -> None:
    """Keep ``Results`` from storing ``None`` for a skipped copy, over the result of the copy that runs."""
    message.options["store_results"] = False


def store_failure(broker: "Broker", message: Any, error: Exception) -> None:
    """Store ``error`` as ``message``'s result in each ``Results`` of ``broker`` that stores it, and nothing else."""
    from dramatiq.results import Results

    for middleware in broker.middleware:
        if not isinstance(middleware, Results):
            continue
        stores, ttl = result_options(middleware, broker, message)
        if stores:
            try:
                middleware.backend.store_exception(message, error, ttl)
            except Exception as e:  # the result store is not ours to fail the delivery over
                logger.warning("Could not store why %s did not run: %r", message, e)
    store_nothing(message)
