"""Taking and releasing locks around the actor, in the worker.

A run lock is owned by a token per execution and kept alive as a
lease.  A delivery that meets a held run lock follows the actor's
server strategy; ``reschedule`` re-enqueues it with a delay and also
registers it as a waiter, so the holder's release hands the key over at
once.  Whichever of the two copies arrives second is skipped.
"""

from __future__ import annotations

import itertools
import os
import random
import time
from typing import TYPE_CHECKING, Optional

from dramatiq import Message
from dramatiq.middleware import SkipMessage

from .delivery import Delivery, attach, message_id_of, set_fence
from .errors import LockConflict, Rescheduled
from .events import LockEvent
from .handoff import HandoffPolls
from .leases import Lease
from .releaser import Outcome, PendingRelease
from .spec import ActorSpec

if TYPE_CHECKING:
    from dramatiq import Broker
    from dramatiq.broker import MessageProxy

    from .backend import Acquisition, LockBackend
    from .middleware import UniqueMiddleware


class ProcessGuard:
    """The worker side of one middleware."""

    def __init__(self, middleware: "UniqueMiddleware") -> None:
        self.middleware = middleware
        # Owner tokens must differ between executions of one message,
        # even in two processes forked from one parent.
        self._tokens = itertools.count()
        self._token_prefix = f"{random.getrandbits(32):08x}"
        self.handoffs = HandoffPolls()

    @property
    def backend(self) -> "LockBackend":
        backend = self.middleware.backend
        assert backend is not None
        return backend

    def start(self, broker: "Broker", message: "MessageProxy", spec: ActorSpec) -> None:
        """Take what the lock type takes before the actor runs."""
        stamped = message.options.get("unique_digest")
        digest = stamped or spec.digest(message.args, message.kwargs)
        message.options["unique_digest"] = digest  # so a retry re-enters, even if the sender had no middleware
        # An unstamped message took no enqueue lock (sent while disabled, or without the middleware).
        state = attach(message, Delivery(spec, digest, queue_released=not stamped))
        if spec.lock.run_lock:
            self._take_run_lock(broker, message, state)
        if spec.lock.queue_release == "run_start":
            self.release_queue_lock(message, state, strict=True)

    def _owner(self, message: "MessageProxy") -> str:
        return f"{message.message_id}/{self._token_prefix}.{os.getpid():x}.{next(self._tokens):x}"

    def _take_run_lock(self, broker: "Broker", message: "MessageProxy", state: Delivery) -> None:
        middleware, spec = self.middleware, state.spec
        key = middleware.key(spec, state.digest, "run")
        if not self._claim(message, key):
            state.keeps_queue_lock = True
            raise SkipMessage("a copy of this message was handed the lock first")
        owner = self._owner(message)
        taken_at = time.monotonic() * 1000
        try:
            got = self._acquire_run(message, state, key, owner)
        except Exception as e:
            error = middleware.backend_error("take the run lock", key, spec, message, e)
            if middleware.settings.on_backend_error == "run_unlocked":
                middleware.logger.warning("Running %s without its lock %r.", message, key)
                return
            raise error from e
        if not got.acquired:
            self._on_conflict(broker, message, state, key, got.holder)
        state.run_key, state.run_owner, state.fence = key, owner, got.fence
        state.lease = middleware.leases.hold(key, owner, taken_at, actor=spec.actor_name)
        set_fence(got.fence)
        middleware.emit("locked", spec, key, message)

    def _acquire_run(self, message: "MessageProxy", state: Delivery, key: str, owner: str) -> "Acquisition":
        """Take the run lock.  A lock type that releases its enqueue lock
        as the run starts releases it in the same round trip, and only
        once the run lock is taken: a conflict leaves it to the
        conflict strategy, as before.
        """
        spec, lease = state.spec, self.middleware.settings.lease
        if state.queue_released or spec.lock.queue_release != "run_start":
            return self.backend.acquire(key, owner, ttl=lease, limit=spec.lock_limit, lock=spec.lock.name)
        queue_key = self.middleware.key(spec, state.digest, "queue")
        got, queue_held = self.backend.take_run(
            key, owner, queue_key, message.message_id, ttl=lease, limit=spec.lock_limit, lock=spec.lock.name
        )
        if queue_held is not None:
            state.queue_released = True
            self._queue_lock_released(message, state, queue_key, queue_held)
        return got

    def _queue_lock_released(self, message: "MessageProxy", state: Delivery, key: str, held: bool) -> None:
        middleware = self.middleware
        if held:
            middleware.emit("released", state.spec, key, message)
            return
        middleware.logger.warning(
            "Lock %r of message %s lapsed before it was released: raise its lock_ttl.", key, message.message_id
        )
        middleware.emit("lock_lost", state.spec, key, message)

    def _claim(self, message: "MessageProxy", key: str) -> bool:
        attempt = message.options.get("unique_reschedules", 0)
        return not attempt or self.backend.claim(key, f"{message.message_id}:{attempt}")

    def _on_conflict(
        self, broker: "Broker", message: "MessageProxy", state: Delivery, key: str, holder: Optional[str]
    ) -> None:
        middleware, spec = self.middleware, state.spec
        if spec.server == "reschedule":
            self._reschedule(broker, message, state, key)
        middleware.emit("conflict", spec, key, message, holder)
        holder_id = message_id_of(holder)
        if spec.server == "raise":
            raise LockConflict(f"Run lock {key!r} is held by message {holder_id}.", key=key, holder=holder_id)
        if spec.server == "reject":
            middleware.logger.warning("Dead-lettering %s: run lock %r is held by message %s.", message, key, holder_id)
            message.fail()
        else:
            middleware.logger.warning("Dropping %s: run lock %r is held by message %s.", message, key, holder_id)
        message.options["store_results"] = False
        raise SkipMessage(f"run lock {key!r} is held")

    def _reschedule(self, broker: "Broker", message: "MessageProxy", state: Delivery, key: str) -> None:
        middleware, spec = self.middleware, state.spec
        attempt = message.options.get("unique_reschedules", 0) + 1
        base = spec.reschedule_delay if spec.reschedule_delay is not None else middleware.settings.reschedule_delay
        copy = message.copy(options={"unique_reschedules": attempt, "unique_digest": state.digest})
        ticket = f"{message.message_id}:{attempt}"
        # Register before enqueueing: a delayed copy that arrived first
        # would find no ticket to claim, and the hand-off would run it again.
        try:
            order = int(message.message_timestamp)
            self.backend.wait(key, ticket, copy.encode(), order=order, ttl=middleware.settings.lock_ttl)
        except Exception as e:
            middleware.emit("backend_error", spec, key, message)
            middleware.logger.warning(
                "Could not register %s as waiting for %r (%r); it runs after its delay.", message, key, e
            )
        try:
            broker.enqueue(copy, delay=int(base * random.uniform(0.8, 1.2)))
        except Exception as e:
            self._withdraw(key, ticket, spec, message)
            raise middleware.backend_error("reschedule a message waiting for", key, spec, message, e) from e
        state.keeps_queue_lock = True
        message.options["store_results"] = False
        middleware.emit("rescheduled", spec, key, message)
        middleware.logger.debug("Rescheduled %s: run lock %r is held.", message, key)
        raise Rescheduled(f"run lock {key!r} is held; rescheduled")

    def _withdraw(self, key: str, ticket: str, spec: ActorSpec, message: "MessageProxy") -> None:
        """Take back a waiter whose delayed copy was never enqueued, so
        no hand-off runs it beside the retry of the original.
        """
        try:
            self.backend.claim(key, ticket)
        except Exception as e:
            self.middleware.backend_error("withdraw the waiter of", key, spec, message, e)

    def release_queue_lock(self, message: "MessageProxy", state: Delivery, strict: bool = False) -> None:
        """Release the enqueue lock, once, unless the lock type has none
        or keeps it until it expires; ``strict`` raises on a backend
        failure so the delivery is retried instead of leaving the lock
        to block new sends until it expires.
        """
        if state.queue_released or state.spec.lock.queue_release in (None, "expiry"):
            return
        middleware = self.middleware
        key = middleware.key(state.spec, state.digest, "queue")
        try:
            released = self.backend.release(key, message.message_id)
        except Exception as e:
            error = middleware.backend_error("release", key, state.spec, message, e)
            if strict:
                raise error from e
            return
        state.queue_released = True
        if released.held:
            middleware.emit("released", state.spec, key, message)
            return
        middleware.logger.warning(
            "Lock %r of message %s lapsed before it was released: raise its lock_ttl.", key, message.message_id
        )
        middleware.emit("lock_lost", state.spec, key, message)

    def end_run(self, broker: "Broker", message: "MessageProxy", state: Delivery) -> None:
        """Release the run lock of this delivery, once, and hand the key
        to its longest waiter: in the background when the backend
        batches releases (see :mod:`dramatiq_unique.releaser`).
        """
        if state.run_key is None or state.run_owner is None:
            return
        middleware = self.middleware
        key, owner, lease, spec = state.run_key, state.run_owner, state.lease, state.spec
        state.run_key = state.run_owner = state.lease = None
        set_fence(None)
        if lease is not None:
            middleware.leases.drop(lease)

        def done(outcome: Outcome) -> None:
            self._released(broker, message, spec, key, owner, lease, outcome)

        releaser = middleware.releaser
        if releaser is not None:
            releaser.submit(PendingRelease(key, owner, spec.actor_name, done))
            return
        try:
            outcome: Outcome = self.backend.release(key, owner)
        except Exception as e:
            outcome = e
        done(outcome)

    def _released(
        self,
        broker: "Broker",
        message: "MessageProxy",
        spec: ActorSpec,
        key: str,
        owner: str,
        lease: Optional[Lease],
        outcome: Outcome,
    ) -> None:
        middleware = self.middleware
        if isinstance(outcome, Exception):
            middleware.backend_error("release", key, spec, message, outcome)
            return
        if outcome.held:
            middleware.emit("released", spec, key, message)
        elif lease is None or not lease.lost:
            self.report_lost(spec.actor_name, key, owner)
        if outcome.promoted is not None:
            self._promote(broker, key, outcome.promoted)

    def releases_stalled(self, batch: list[PendingRelease]) -> None:
        """Report releases still waiting for the backend."""
        self.middleware.logger.error(
            "Lock backend %s has not answered %d release(s) for %.0f ms; the keys stay held until it does "
            "or their leases expire.",
            self.backend.describe(),
            len(batch),
            time.monotonic() * 1000 - min(pending.submitted_at for pending in batch),
        )
        for pending in batch:
            self.middleware.events.emit(
                LockEvent("backend_error", pending.actor, pending.key, message_id_of(pending.owner))
            )

    def _promote(self, broker: "Broker", key: str, encoded: bytes) -> None:
        try:
            promoted = broker.enqueue(Message.decode(encoded))
        except Exception as e:
            self.middleware.logger.warning(
                "Could not hand %r to its next waiter (%r); it runs after its delay.", key, e
            )
            return
        self.handoffs.handed_over(promoted.queue_name)

    def lease_lost(self, lease: Lease) -> None:
        self.report_lost(lease.actor, lease.key, lease.owner)

    def renewal_failed(self, lease: Lease) -> None:
        self.middleware.events.emit(LockEvent("backend_error", lease.actor, lease.key, message_id_of(lease.owner)))

    def report_lost(self, actor: str, key: str, owner: str) -> None:
        self.middleware.logger.error(
            "Lock %r was lost: message %s no longer holds it (its lease expired or it was taken over).",
            key,
            message_id_of(owner),
        )
        self.middleware.events.emit(LockEvent("lock_lost", actor, key, message_id_of(owner)))
