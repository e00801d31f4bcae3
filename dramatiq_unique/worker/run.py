"""Taking and releasing locks around the actor, in the worker.

A run lock is owned by a token per execution and kept alive as a
lease.  A delivery that meets a held run lock follows the actor's
server strategy; ``reschedule`` re-enqueues it with a delay and also
registers it as a waiter, so the holder's release hands the key over at
once.  Of its copies (and of the retry of the delivery, when a call of
the reschedule failed after it may have been applied), the first to
arrive wins the reschedule; the others, and every stale copy, are
skipped.  ``docs/reliability.md``,
"The hand-off model", has the rules.
"""

from __future__ import annotations

import itertools
import time
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, NoReturn, Optional

from dramatiq import Message
from dramatiq.middleware import AgeLimit, SkipMessage

from ..backends.base import Copy, CopyVerdict, Release, Reschedules
from ..compat import age_limit_module
from ..errors import CopySkipped, LockConflict, Rescheduled
from ..events import LockEvent
from ..forks import pid
from ..model.spec import ActorSpec
from ..send.context import LockService
from ..send.copies import copy_of, message_id_of, send_order
from ..clock import JITTER
from ..send.results import store_failure, store_nothing
from .coroutines import watch
from .delivery import Delivery, attach, set_fence
from .handoff import HandoffPolls
from .leases import Lease
from .releaser import Outcome, PendingRelease
from .superseded import skip_if_superseded
from .unreleased import FailedRelease

if TYPE_CHECKING:
    from dramatiq import Broker
    from dramatiq.broker import MessageProxy

    from ..backends.base import LockBackend
    from .leases import LeaseKeeper
    from .releaser import Releaser
    from .unreleased import ReleaseRetries

#: Why a copy of a message may not run, by the claim's verdict.
SKIP_REASONS = {
    CopyVerdict.STALE: "it was rescheduled again, and a later copy of it runs",
    CopyVerdict.LOST: "the other copy of its reschedule arrived first",
    CopyVerdict.DONE: "it duplicates a run of its message that succeeded",
}

#: A slot handed to a waiter stays reserved for its message this many
#: reschedule delays (the longest a delayed copy of it takes to come,
#: when its hand-off copy is lost), plus RESERVE_SLACK milliseconds.
RESERVE_DELAYS = 2
RESERVE_SLACK = 1_000

#: A delayed copy that comes back while its message is still in line
#: waits twice as long each time, at most this many reschedule delays.
MAX_BACKOFF = 8

#: A waiter with more than this many waiters ahead of it sends its first
#: delayed copy twice as late, four times past twice as many, and so on
#: (at most MAX_BACKOFF delays): its hand-off comes long before, and its
#: delayed copy, a fallback, would only come back to wait again.
LINE_STEP = 100


class RunHelpers(NamedTuple):
    """The worker-side helpers of one middleware.  Each is bound to the
    middleware's current backend and made on first use, so they are
    passed as getters.
    """

    leases: Callable[[], "LeaseKeeper"]
    releaser: Callable[[], Optional["Releaser"]]
    release_retries: Callable[[], "ReleaseRetries"]
    #: Async actors with a run lock, whose coroutines are tracked.
    async_actors: set[str]


class ProcessGuard:
    """The worker side of one middleware."""

    def __init__(self, service: LockService, *, run: "RunHelpers") -> None:
        self.service = service
        self.run = run
        # Owner tokens must differ between executions of one message,
        # even in two processes forked from one parent.
        self._tokens = itertools.count()
        self._token_prefix = f"{JITTER.getrandbits(32):08x}"
        self.handoffs = HandoffPolls()
        # The stack last seen (held, so that no other list can take its
        # identity), its length, and per actor what _age_limit_of found.
        self._age_limits: tuple[Optional[list[Any]], int, dict[str, tuple[bool, Optional[int]]]] = (None, -1, {})

    @property
    def backend(self) -> "LockBackend":
        backend = self.service.backend
        assert backend is not None
        return backend

    def start(self, broker: "Broker", message: "MessageProxy", raw: Message, spec: ActorSpec) -> None:
        """Take what the lock type takes before the actor runs: for
        ``message`` and ``raw``, the message it proxies.
        """
        options = raw.options
        stamped = options.get("unique_digest")
        digest = stamped or spec.digest(raw.args, raw.kwargs)
        options["unique_digest"] = digest  # so a retry re-enters, even if the sender had no middleware
        # An unstamped message took no enqueue lock (sent while disabled, or without the middleware).
        state = attach(message, Delivery(spec, digest, queue_released=not stamped))
        skip_if_superseded(self.service, broker, message, state)
        if not spec.lock.run_lock:
            if spec.lock.queue_release == "run_start":
                self.release_queue_lock(message, state, strict=True)
        elif self._expired(broker, raw):
            # AgeLimit, after us, dead-letters it; only one copy of it may be.
            self._settle(message, state, strict=True)
        else:
            self._take_run_lock(broker, message, raw, state)

    def _expired(self, broker: "Broker", message: Any) -> bool:
        """Whether AgeLimit, after us in the stack, will dead-letter
        ``message`` as too old: then it must take no lock, and never be
        rescheduled past its age.
        """
        limited, default = self._age_limit_of(broker, message.actor_name)
        if not limited:
            return False
        max_age = message.options.get("max_age") or default
        # Looked up at call time, like AgeLimit's own clock.
        return bool(max_age) and age_limit_module.current_millis() - message.message_timestamp >= max_age

    def _age_limit_of(self, broker: "Broker", actor_name: str) -> tuple[bool, Optional[int]]:
        """Whether the stack has an AgeLimit, and the actor's max_age
        under it: found once per actor and stack, not on every job.
        """
        stack = broker.middleware
        seen, size, found = self._age_limits
        if seen is not stack or size != len(stack):
            found = {}
            self._age_limits = (stack, len(stack), found)
        try:
            return found[actor_name]
        except KeyError:
            age_limit = _age_limit(stack)
            if age_limit is None:
                found[actor_name] = (False, None)
            else:
                found[actor_name] = (True, broker.get_actor(actor_name).options.get("max_age", age_limit.max_age))
            return found[actor_name]

    def _owner(self, message: Message) -> str:
        return f"{message.message_id}/{self._token_prefix}.{pid():x}.{next(self._tokens):x}"

    def _take_run_lock(self, broker: "Broker", message: "MessageProxy", raw: Message, state: Delivery) -> None:
        service, spec = self.service, state.spec
        key = service.key(spec, state.digest, "run")
        queue_key = None
        if spec.lock.queue_release == "run_start" and not state.queue_released:
            queue_key = service.key(spec, state.digest, "queue")
        owner = self._owner(raw)
        taken_at = time.monotonic() * 1000
        # Set before the call: one whose reply is lost may have taken it.
        state.run_key, state.run_owner = key, owner
        # Releases pending in this process ride in front of the call.
        starter = self.run.releaser() or self.backend
        try:
            started = starter.start(
                key,
                owner,
                ttl=service.settings.lease,
                limit=spec.lock_limit,
                lock=spec.lock.name,
                copy=copy_of(raw, key),
                queue_key=queue_key,
                order=send_order(raw),
                reserve=self.reserve(spec),
            )
        except Exception as e:
            error = service.backend_error("take the run lock", key, spec, message, e)
            if service.settings.on_backend_error == "run_unlocked":
                service.logger.warning("Running %s without its lock %r.", message, key)
                self.release_queue_lock(message, state)
                return
            raise error from e
        got, state.claimed = started.acquisition, True
        if started.promoted is not None:
            self._promote(broker, key, started.promoted)  # the free key went to an older waiter
        if not got.acquired:
            state.run_key = state.run_owner = None
            if got.refused:
                self._skip_copy(message, state, got.refused, started.duplicate_of)
            if started.in_line and spec.server == "reschedule":
                self._wait_longer(broker, message, state, key, started.free_in)
            self._on_conflict(broker, message, state, key, got.holder)
        if queue_key is not None:
            self._queue_lock_released(message, state, queue_key, started.queue_released)
        state.run_confirmed, state.fence = True, got.fence
        if spec.actor_name in self.run.async_actors:
            state.coroutine = watch()
        state.lease = self.run.leases().hold(key, owner, taken_at, actor=spec.actor_name)
        set_fence(got.fence)
        service.emit("locked", spec, key, raw)

    def _settle(self, message: "MessageProxy", state: Delivery, strict: bool = False) -> None:
        """Claim a copy that will not start, so that no other copy of
        its message starts either; skip it if another copy won.
        ``strict`` raises on a backend failure, so that the delivery is
        retried rather than dead-lettered beside a copy that won.
        """
        service = self.service
        copy = copy_of(message, service.key(state.spec, state.digest, "run"))
        if state.claimed or not copy.attempt:
            return
        try:
            may_run = Reschedules.require(self.service.locks, feature="a rescheduled message").claim(copy)
        except Exception as e:
            error = service.backend_error("settle the copies of", copy.key, state.spec, message, e)
            if strict and service.settings.on_backend_error == "fail":
                raise error from e
            return
        state.claimed = True
        if not may_run:
            self._skip_copy(message, state, CopyVerdict.LOST)

    def _skip_copy(
        self, message: "MessageProxy", state: Delivery, verdict: CopyVerdict, duplicate_of: Optional[str] = None
    ) -> NoReturn:
        """Skip a copy of a message that another copy of it stands for.
        A duplicate of a run that succeeded is said at INFO, naming that
        run: it is the one skip of a message that may be an operator's
        replay.
        """
        state.keeps_queue_lock = state.quiet_skip = True  # the copy that runs owns the message's locks
        store_nothing(message)
        reason = SKIP_REASONS[verdict]
        key = self.service.key(state.spec, state.digest, "run")
        self.service.emit("skipped", state.spec, key, message, duplicate_of, reason=verdict.value)
        if verdict is CopyVerdict.DONE:
            self.service.logger.info(
                "Skipped %s: it duplicates run %s of message %s, which succeeded (lock %r).",
                message,
                duplicate_of or "?",
                message.message_id,
                key,
            )
        else:
            self.service.logger.debug("Skipped %s: %s.", message, reason)
        raise CopySkipped(f"skipped: {reason}")

    def reserve(self, spec: ActorSpec) -> int:
        """How long a slot handed to a waiter of ``spec`` stays reserved
        for it, in milliseconds.
        """
        return RESERVE_DELAYS * self._delay(spec) + RESERVE_SLACK

    def _delay(self, spec: ActorSpec) -> int:
        return spec.reschedule_delay if spec.reschedule_delay is not None else self.service.settings.reschedule_delay

    def _wait_longer(
        self, broker: "Broker", message: "MessageProxy", state: Delivery, key: str, free_in: Optional[int]
    ) -> NoReturn:
        """A delayed copy came back while its message is still in line:
        the backend changed nothing, and it only comes back later, each
        time twice as late (at most ``MAX_BACKOFF`` delays), but no later
        than just after the key's holder runs out (``free_in``), should
        it die: then the first copy to arrive hands the key to the oldest
        waiter.  Should the enqueue fail, it is rescheduled as a new
        attempt (:meth:`_reschedule`).
        """
        service, spec = self.service, state.spec
        waits = message.options.get("unique_waits", 0) + 1
        base = self._delay(spec)
        delay = base * min(2**waits, MAX_BACKOFF) * JITTER.uniform(0.8, 1.2)
        if free_in is not None and free_in >= 0:
            delay = min(delay, free_in + base * JITTER.uniform(0.05, 0.25))
        try:
            broker.enqueue(message.copy(options={"unique_waits": waits}), delay=int(delay))
        except Exception:
            # It may have been applied.  A retry of this very copy would have one retry more than
            # the run that the key is handed to, and run after it: reschedule anew instead, as a
            # new attempt (the possibly queued copy is then stale), with its own stand-in.
            self._reschedule(broker, message, state, key)
        state.keeps_queue_lock = state.quiet_skip = True
        store_nothing(message)
        service.emit("rescheduled", spec, key, message)
        service.logger.debug("Rescheduled %s again: it is still in line for run lock %r.", message, key)
        raise Rescheduled(f"run lock {key!r} is held; still in line")

    def _on_conflict(
        self, broker: "Broker", message: "MessageProxy", state: Delivery, key: str, holder: Optional[str]
    ) -> NoReturn:
        service, spec = self.service, state.spec
        if spec.server == "reschedule":
            self._reschedule(broker, message, state, key)
        service.emit("conflict", spec, key, message, holder)
        holder_id = message_id_of(holder)
        error = LockConflict(f"Run lock {key!r} is held by message {holder_id}.", key=key, holder=holder_id)
        if spec.server == "raise":
            raise error
        store_failure(broker, message, error)
        if spec.server == "reject":
            service.logger.warning("Dead-lettering %s: run lock %r is held by message %s.", message, key, holder_id)
            message.fail()
        else:
            service.logger.warning("Dropping %s: run lock %r is held by message %s.", message, key, holder_id)
        raise SkipMessage(f"run lock {key!r} is held")

    def _reschedule(self, broker: "Broker", message: "MessageProxy", state: Delivery, key: str) -> NoReturn:
        service, spec = self.service, state.spec
        attempt = message.options.get("unique_reschedules", 0) + 1
        base = self._delay(spec)
        options = {"unique_reschedules": attempt, "unique_digest": state.digest, "unique_waits": 0}
        # Register before enqueueing: a delayed copy that arrived first
        # would find no record, and the hand-off would run it again.
        try:
            handed = message.copy(options={**options, "unique_via": "handoff"})
            waiting = Copy(key, message.message_id, attempt, "handoff")
            order, ttl = send_order(message), service.settings.lock_ttl
            rescheduling = Reschedules.require(service.locks, feature="on_conflict='reschedule'")
            ahead = rescheduling.wait(waiting, handed.encode(), order=order, ttl=ttl)
        except Exception as e:
            # It may have been applied: a hand-off copy of the attempt may come.
            self._stand_in(message, state, attempt)
            raise service.backend_error("register a message waiting for", key, spec, message, e) from e
        try:
            delayed = message.copy(options={**options, "unique_via": "delay"})
            # (a backend written against the older wait, which returned None, has no line to tell)
            factor = _line_factor(ahead if isinstance(ahead, int) else 0)
            broker.enqueue(delayed, delay=int(base * factor * JITTER.uniform(0.8, 1.2)))
        except Exception as e:
            # It may have been applied: the delayed copy may be queued.
            self._stand_in(message, state, attempt)
            raise service.backend_error("reschedule a message waiting for", key, spec, message, e) from e
        state.keeps_queue_lock = state.quiet_skip = True
        store_nothing(message)
        service.emit("rescheduled", spec, key, message)
        service.logger.debug("Rescheduled %s: run lock %r is held.", message, key)
        raise Rescheduled(f"run lock {key!r} is held; rescheduled")

    @staticmethod
    def _stand_in(message: "MessageProxy", state: Delivery, attempt: int) -> None:
        """Make this delivery's retry a third copy of ``attempt``, after
        a call of the reschedule whose outcome is unknown: the delayed
        and the hand-off copy may or may not exist, and of the three the
        first to arrive runs and the others are skipped (Retries
        re-enqueues this very message, with these options).  Should
        Retries give up instead, this copy of the attempt is unclaimed:
        its dead-letter claims it, so that no other copy runs.
        """
        message.options["unique_reschedules"] = attempt
        message.options["unique_via"] = "retry"
        state.claimed = False

    def retire(self, message: "MessageProxy", state: Delivery) -> None:
        """A copy is dead-lettered: make sure no other copy of its
        message runs, and that it leaves no waiter behind.
        """
        if state.spec.lock.run_lock:
            try:
                self._settle(message, state)
            except SkipMessage:
                pass

    def release_queue_lock(self, message: "MessageProxy", state: Delivery, strict: bool = False) -> None:
        """Release the enqueue lock, once, unless the lock type has none
        or keeps it until it expires; ``strict`` raises on a backend
        failure so the delivery is retried instead of leaving the lock
        to block new sends until it expires.
        """
        if state.queue_released or state.spec.lock.queue_release in (None, "expiry"):
            return
        service = self.service
        key = service.key(state.spec, state.digest, "queue")
        try:
            released = self.backend.release(key, message.message_id)
        except Exception as e:
            error = service.backend_error("release", key, state.spec, message, e)
            if strict:
                raise error from e
            state.queue_released = True
            until = time.monotonic() * 1000 + service.queue_lock_ttl(state.spec)
            landed = partial(self._released_again, None, message, state.spec, key)
            self.run.release_retries().submit(FailedRelease(key, message.message_id, until, landed))
            return
        self._queue_lock_released(message, state, key, released.held)

    def _queue_lock_released(self, message: "MessageProxy", state: Delivery, key: str, held: bool) -> None:
        service = self.service
        state.queue_released = True
        if held:
            service.emit("released", state.spec, key, message)
            return
        service.logger.warning(
            "Lock %r of message %s lapsed before it was released: raise its lock_ttl.", key, message.message_id
        )
        service.emit("lock_lost", state.spec, key, message)

    def end_run(self, broker: "Broker", message: "MessageProxy", state: Delivery, *, succeeded: bool) -> None:
        """Release the run lock of this delivery, once, and hand the key
        to its longest waiter: in the background when the backend
        batches releases (see :mod:`dramatiq_unique.worker.releaser`).
        ``succeeded``: the run leaves nothing to do, and finishes its
        message (a failed run never does, whatever becomes of its retry).
        """
        if state.run_key is None or state.run_owner is None:
            return
        service = self.service
        coroutine = state.coroutine
        if coroutine is not None and coroutine.defer(
            partial(self.end_run, broker, message, state, succeeded=succeeded)
        ):
            service.logger.error(
                "Message %s is still running after it was interrupted: its run lock %r is kept until it ends.",
                message,
                state.run_key,
            )
            return
        key, owner, lease, spec = state.run_key, state.run_owner, state.lease, state.spec
        confirmed = state.run_confirmed
        state.run_key = state.run_owner = state.lease = None
        set_fence(None)
        if lease is not None:
            self.run.leases().drop(lease)
        # A partial, not a closure: one Python frame less per release.
        done = partial(self._released, broker, message, spec, key, owner, lease, confirmed, succeeded)
        releaser = self.run.releaser()
        reserve = self.reserve(spec)
        if releaser is not None:
            pending = PendingRelease(key, owner, spec.actor_name, done, succeeded=succeeded, reserve=reserve)
            # A message that waited for its key most likely leaves waiters behind, the next of which waits for
            # this release: it goes at once rather than lingering for another call to ride with.
            if message.options.get("unique_reschedules"):
                releaser.release_now(pending)
            else:
                releaser.submit(pending)
            return
        try:
            outcome: Outcome = self.backend.release(key, owner, succeeded=succeeded, reserve=reserve)
        except Exception as e:
            outcome = e
        hand_over = done(outcome)
        if hand_over is not None:
            hand_over()

    def _released(
        self,
        broker: "Broker",
        message: "MessageProxy",
        spec: ActorSpec,
        key: str,
        owner: str,
        lease: Optional[Lease],
        confirmed: bool,
        succeeded: bool,
        outcome: Outcome,
    ) -> Optional[Callable[[], None]]:
        """Report a release; return the hand-off to do, if it handed the
        key to a waiter: the caller does it where no job waits for it.
        A release that failed is sent again saying how the run ended.
        """
        service = self.service
        if isinstance(outcome, Exception):
            service.backend_error("release", key, spec, message, outcome)
            # Sent again off this thread until it lands or the lease has run out.
            until = lease.expires_at if lease is not None else time.monotonic() * 1000 + service.settings.lease
            landed = partial(self._released_again, broker, message, spec, key)
            self.run.release_retries().submit(FailedRelease(key, owner, until, landed, succeeded=succeeded))
            return None
        if outcome.held:
            service.emit("released", spec, key, message)
        elif confirmed and (lease is None or not lease.lost):
            self.report_lost(spec.actor_name, key, owner)
        promoted = outcome.promoted
        if promoted is None:
            return None
        return lambda: self._promote(broker, key, promoted)

    def _released_again(
        self, broker: Optional["Broker"], message: Any, spec: ActorSpec, key: str, outcome: Release
    ) -> Optional[Callable[[], None]]:
        """Report a release that landed on a retry.  Its first send may
        have been applied, so an owner found gone is no lost lock.
        """
        if outcome.held:
            self.service.emit("released", spec, key, message)
        promoted = outcome.promoted
        if promoted is None or broker is None:
            return None
        return lambda: self._promote(broker, key, promoted)

    def releases_stalled(self, batch: list[PendingRelease]) -> None:
        """Report releases still waiting for the backend."""
        self.service.logger.error(
            "Lock backend %s has not answered %d release(s) for %.0f ms; the keys stay held until it does "
            "or their leases expire.",
            self.backend.describe(),
            len(batch),
            time.monotonic() * 1000 - min(pending.submitted_at for pending in batch),
        )
        for pending in batch:
            self.service.events.emit(
                LockEvent("backend_error", pending.actor, pending.key, message_id_of(pending.owner))
            )

    def _promote(self, broker: "Broker", key: str, encoded: bytes) -> None:
        try:
            promoted = broker.enqueue(Message.decode(encoded))
        except Exception as e:
            self.service.logger.warning(
                "Could not hand %r to its next waiter (%r); it runs after its delay.", key, e
            )
            return
        self.handoffs.handed_over(promoted.queue_name)

    def lease_lost(self, lease: Lease) -> None:
        self.report_lost(lease.actor, lease.key, lease.owner)

    def renewal_failed(self, lease: Lease) -> None:
        self.service.events.emit(LockEvent("backend_error", lease.actor, lease.key, message_id_of(lease.owner)))

    def report_lost(self, actor: str, key: str, owner: str) -> None:
        self.service.logger.error(
            "Lock %r was lost: message %s no longer holds it (its lease expired or it was taken over).",
            key,
            message_id_of(owner),
        )
        self.service.events.emit(LockEvent("lock_lost", actor, key, message_id_of(owner)))


def _line_factor(ahead: int) -> int:
    """How many reschedule delays the first delayed copy of a waiter
    with ``ahead`` waiters ahead of it waits.
    """
    factor = 1
    while ahead > LINE_STEP * factor and factor < MAX_BACKOFF:
        factor *= 2
    return factor


def _age_limit(stack: list[Any]) -> Optional[AgeLimit]:
    return next((middleware for middleware in stack if isinstance(middleware, AgeLimit)), None)
