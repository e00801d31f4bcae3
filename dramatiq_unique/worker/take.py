"""Taking the run lock before the actor runs (:class:`RunLockTaker`), and
what a delivery does when it may not run: a held key (:data:`ON_CONFLICT`),
a superseded message, a copy another copy stands for.  Deliveries
skipped on purpose log at DEBUG, and :class:`QuietSkips` drops
Dramatiq's "Message ... was skipped." WARNING for them.  See
docs/reliability.md, "A held key, a superseded message, quiet skips",
and "The hand-off model".
"""

from __future__ import annotations

import itertools
import logging
import threading
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple, NoReturn, Optional, cast

from dramatiq import Message
from dramatiq.middleware import AgeLimit, SkipMessage

from ..backends.capabilities import NewestWins, Reschedules
from ..backends.records import Copy, CopyVerdict, CurrentStatus, Start
from ..background import JITTER, now_ms, pid
from ..compat import SKIPPED_MESSAGE_LOG, WORKER_THREAD_LOGGER, age_limit_module
from ..errors import CopySkipped, LockConflict, Rescheduled, Superseded
from ..model.spec import ActorSpec
from ..model.wire import UNIQUE_DIGEST, UNIQUE_RESCHEDULES, UNIQUE_VIA, UNIQUE_WAITS, join_owner, message_id_of
from ..model.wire import malformed_options
from ..send.context import LockContext, copy_of, send_order, store_failure, store_nothing
from .leases import Delivery, attach, delivery, set_fence, watch
from .release import HandOff, Unlocker

if TYPE_CHECKING:
    from dramatiq import Broker
    from dramatiq.broker import MessageProxy


def _reschedules(service: LockContext, feature: str) -> Reschedules:
    """The backend as one that reschedules: checked when the actor was declared, so only looked at."""
    backend = service.locks
    return backend if isinstance(backend, Reschedules) else Reschedules.require(backend, feature=feature)


class Outcome(Enum):
    """What one take of a run lock came to."""

    #: The run lock is the delivery's: the actor runs.
    ACQUIRED = "acquired"
    #: Another copy of its message stands for this one.
    REFUSED = "refused"
    #: A delayed copy whose message is still in line for the key.
    IN_LINE = "in_line"
    #: Another message holds the key (or it is reserved for one).
    HELD = "held"


class Taken(NamedTuple):
    """One take of a run lock, and the backend's answer to it."""

    broker: "Broker"
    message: "MessageProxy"
    raw: Message
    state: Delivery
    key: str
    owner: str
    #: Monotonic ms, just before the call: the lease counts from then.
    taken_at: float
    #: The enqueue lock the take released with it (``queue_release="run_start"``).
    queue_key: Optional[str]
    started: Start


class RunLockTaker:
    """Takes the run lock of each delivery of one middleware.  ``unlocker`` releases the enqueue
    lock a take frees, and owns the worker's threads; ``async_actors`` have their coroutines tracked.
    """

    def __init__(self, service: LockContext, unlocker: Unlocker, *, async_actors: set[str]) -> None:
        self.service = service
        self.unlocker = unlocker
        self.async_actors = async_actors
        # Owner tokens differ between executions, even in processes forked from one parent.
        self._tokens = itertools.count()
        self._token_prefix = f"{JITTER.getrandbits(32):08x}"
        # The stack last seen (held: no other list takes its id), its length, and per actor its limit.
        self._age_limits: tuple[Optional[list[Any]], int, dict[str, tuple[bool, Optional[int]]]] = (None, -1, {})

    def take(self, broker: "Broker", message: "MessageProxy", raw: Message, spec: ActorSpec) -> None:
        """Take what the lock type takes before the actor runs (``raw``: the proxied message)."""
        options = raw.options
        for name, must in malformed_options(options):
            # Dropped, so that the message runs as if it had none: never a crash, nor another key's lock.
            self.service.logger.warning(
                "Ignored option %s=%.80r of %s, message %s: it must be %s.",
                name,
                options.pop(name),
                message,
                message.message_id,
                must,
            )
        stamped = options.get(UNIQUE_DIGEST)
        digest = stamped or spec.digest(raw.args, raw.kwargs)
        options[UNIQUE_DIGEST] = digest  # so a retry re-enters, even if the sender had no middleware
        # An unstamped message took no enqueue lock (sent while disabled, or without the middleware).
        state = attach(message, Delivery(spec, digest, queue_released=not stamped))
        skip_if_superseded(self.service, broker, message, state)
        if not spec.lock.run_lock:
            if spec.lock.queue_release == "run_start":
                self.unlocker.release_queue_lock(message, state, strict=True)
        elif self._expired(broker, raw):
            # AgeLimit, after us, dead-letters it; only one copy of it may be.
            self._settle(message, state, strict=True)
        else:
            self._take_run_lock(broker, message, raw, state)

    def retire(self, message: "MessageProxy", state: Delivery) -> None:
        """A copy is dead-lettered: no other copy of its message runs, and no waiter is left."""
        if state.spec.lock.run_lock:
            try:
                self._settle(message, state)
            except SkipMessage:
                pass

    def _expired(self, broker: "Broker", message: Any) -> bool:
        """Whether AgeLimit, after us, dead-letters ``message``: then it takes no lock, nor is rescheduled."""
        limited, default = self._age_limit_of(broker, message.actor_name)
        if not limited:
            return False
        max_age = message.options.get("max_age") or default
        # Looked up at call time, like AgeLimit's own clock.
        return bool(max_age) and age_limit_module.current_millis() - message.message_timestamp >= max_age

    def _age_limit_of(self, broker: "Broker", actor_name: str) -> tuple[bool, Optional[int]]:
        """Whether the stack has an AgeLimit, and the actor's max_age: once per actor and stack."""
        stack = broker.middleware
        seen, size, found = self._age_limits
        if seen is not stack or size != len(stack):
            found = {}
            self._age_limits = (stack, len(stack), found)
        try:
            return found[actor_name]
        except KeyError:
            age_limit = next((middleware for middleware in stack if isinstance(middleware, AgeLimit)), None)
            if age_limit is None:
                found[actor_name] = (False, None)
            else:
                found[actor_name] = (True, broker.get_actor(actor_name).options.get("max_age", age_limit.max_age))
            return found[actor_name]

    def _owner(self, message: Message) -> str:
        return join_owner(message.message_id, f"{self._token_prefix}.{pid():x}.{next(self._tokens):x}")

    def _take_run_lock(self, broker: "Broker", message: "MessageProxy", raw: Message, state: Delivery) -> None:
        """Take the run lock in one call, then do what :data:`ON_OUTCOME` says."""
        service, spec = self.service, state.spec
        key = service.key(spec, state.digest, "run")
        queue_key = None
        if spec.lock.queue_release == "run_start" and not state.queue_released:
            queue_key = service.key(spec, state.digest, "queue")
        owner = self._owner(raw)
        taken_at = now_ms()
        # Set before the call: one whose reply is lost may have taken it.
        state.run_key, state.run_owner = key, owner
        try:
            started = self.unlocker.threads.take_run_lock(
                key,
                owner,
                ttl=service.settings.lease,
                limit=spec.lock_limit,
                lock=spec.lock.name,
                copy=copy_of(raw, key),
                queue_key=queue_key,
                order=send_order(raw),
                reserve=service.reserve(spec),
            )
        except Exception as e:
            error = service.backend_error("take the run lock", key, spec, message, e)
            if service.settings.on_backend_error == "run_unlocked":
                service.logger.warning("Running %s without its lock %r.", message, key)
                self.unlocker.release_queue_lock(message, state)
                return
            raise error from e
        state.claimed = True
        if started.promoted is not None:
            self.unlocker.hand_over(HandOff(broker, key, started.promoted))  # the free key went to an older waiter
        outcome = outcome_of(started, spec)
        if outcome is not Outcome.ACQUIRED:
            state.run_key = state.run_owner = None
        ON_OUTCOME[outcome](self, Taken(broker, message, raw, state, key, owner, taken_at, queue_key, started))

    def _run(self, taken: Taken) -> None:
        """The run lock is the delivery's: confirm it, fence it, keep its lease alive."""
        state, spec, got = taken.state, taken.state.spec, taken.started.acquisition
        if taken.queue_key is not None:
            self.unlocker.queue_lock_released(taken.message, state, taken.queue_key, taken.started.queue_released)
        state.run_confirmed, state.fence = True, got.fence
        if spec.actor_name in self.async_actors:
            state.coroutine = watch()
        state.lease = self.unlocker.threads.leases.hold(taken.key, taken.owner, taken.taken_at, actor=spec.actor_name)
        set_fence(got.fence)
        self.service.emit("locked", spec, taken.key, taken.raw)

    def _skip_refused(self, taken: Taken) -> NoReturn:
        """Another copy of the message stands for this one."""
        started = taken.started
        assert started.acquisition.refused is not None
        skip_copy(self.service, taken.message, taken.state, started.acquisition.refused, started.duplicate_of)

    def _wait_in_line(self, taken: Taken) -> NoReturn:
        """A delayed copy whose message is still in line: it comes back later."""
        wait_longer(self._conflict(taken), taken.started.free_in)

    def _meet_holder(self, taken: Taken) -> NoReturn:
        """Another message holds the key: the actor's server strategy decides."""
        on_conflict(self._conflict(taken))

    def _conflict(self, taken: Taken) -> Conflict:
        holder = taken.started.acquisition.holder
        return Conflict(self.service, taken.broker, taken.message, taken.state, taken.key, holder)

    def _settle(self, message: "MessageProxy", state: Delivery, strict: bool = False) -> None:
        """Claim a copy that will not start, so that no other copy starts; skip it if another won.
        ``strict`` raises on a backend failure: retried, not dead-lettered beside a copy that won.
        """
        service = self.service
        copy = copy_of(message, service.key(state.spec, state.digest, "run"))
        if state.claimed or not copy.attempt:
            return
        try:
            may_run = _reschedules(service, "a rescheduled message").claim(copy)
        except Exception as e:
            error = service.backend_error("settle the copies of", copy.key, state.spec, message, e)
            if strict and service.settings.on_backend_error == "fail":
                raise error from e
            return
        state.claimed = True
        if not may_run:
            skip_copy(service, message, state, CopyVerdict.LOST)


#: What a delivery does, by the outcome of its take.
ON_OUTCOME: Mapping[Outcome, Callable[[RunLockTaker, Taken], None]] = {
    Outcome.ACQUIRED: RunLockTaker._run,
    Outcome.REFUSED: RunLockTaker._skip_refused,
    Outcome.IN_LINE: RunLockTaker._wait_in_line,
    Outcome.HELD: RunLockTaker._meet_holder,
}


def outcome_of(started: Start, spec: ActorSpec) -> Outcome:
    """What the backend's answer to a take comes to, for ``spec``."""
    got = started.acquisition
    if got.acquired:
        return Outcome.ACQUIRED
    if got.refused:
        return Outcome.REFUSED
    if started.in_line and spec.server == "reschedule":
        return Outcome.IN_LINE
    return Outcome.HELD


#: Why a copy of a message may not run, by the claim's verdict.
SKIP_REASONS = {
    CopyVerdict.STALE: "it was rescheduled again, and a later copy of it runs",
    CopyVerdict.LOST: "the other copy of its reschedule arrived first",
    CopyVerdict.DONE: "it duplicates a run of its message that succeeded",
}


#: The most reschedule delays a delayed copy waits (doubling each time it comes back in line).
MAX_BACKOFF = 8

#: Per this many waiters ahead, a first delayed copy waits twice as long (see docs/reliability.md).
LINE_STEP = 100


class Conflict(NamedTuple):
    """A delivery that found its run lock held."""

    service: LockContext
    broker: "Broker"
    message: "MessageProxy"
    state: Delivery
    key: str
    holder: Optional[str]


def on_conflict(conflict: Conflict) -> NoReturn:
    strategy = conflict.state.spec.server
    ON_CONFLICT[strategy if strategy is not None else "log"](conflict)
    raise AssertionError(f"strategy {strategy!r} returned")  # pragma: no cover: every strategy raises


def reschedule(conflict: Conflict) -> NoReturn:
    """Register a hand-off copy as a waiter, then enqueue a delayed copy."""
    service, broker, message, state, key, _ = conflict
    spec = state.spec
    attempt = message.options.get(UNIQUE_RESCHEDULES, 0) + 1
    options = {UNIQUE_RESCHEDULES: attempt, UNIQUE_DIGEST: state.digest, UNIQUE_WAITS: 0}
    # Register first: a delayed copy that arrived first would find no record, and run twice.
    try:
        handed = message.copy(options={**options, UNIQUE_VIA: "handoff"})
        waiting = Copy(key, message.message_id, attempt, "handoff")
        order, ttl = send_order(message), service.settings.lock_ttl
        rescheduling = _reschedules(service, "on_conflict='reschedule'")
        ahead = rescheduling.join_line(waiting, handed.encode(), order=order, ttl=ttl)
    except Exception as e:
        stand_in(message, state, attempt)
        raise service.backend_error("register a message waiting for", key, spec, message, e) from e
    try:
        delayed = message.copy(options={**options, UNIQUE_VIA: "delay"})
        # (a backend written against the older wait, which returned None, has no line to tell)
        factor = _line_factor(ahead if isinstance(ahead, int) else 0)
        broker.enqueue(delayed, delay=int(service.reschedule_delay(spec) * factor * JITTER.uniform(0.8, 1.2)))
    except Exception as e:
        stand_in(message, state, attempt)
        raise service.backend_error("reschedule a message waiting for", key, spec, message, e) from e
    _skip_quietly(conflict)
    service.logger.debug("Rescheduled %s: run lock %r is held.", message, key)
    raise Rescheduled(f"run lock {key!r} is held; rescheduled")


def wait_longer(conflict: Conflict, free_in: Optional[int]) -> NoReturn:
    """A delayed copy came back still in line: it comes back twice as late, but no later than just
    after the holder runs out (``free_in``), should it die: then the first to arrive hands the key on.
    """
    service, broker, message, state, key, _ = conflict
    waits = message.options.get(UNIQUE_WAITS, 0) + 1
    base = service.reschedule_delay(state.spec)
    delay = base * min(2**waits, MAX_BACKOFF) * JITTER.uniform(0.8, 1.2)
    if free_in is not None and free_in >= 0:
        delay = min(delay, free_in + base * JITTER.uniform(0.05, 0.25))
    try:
        broker.enqueue(message.copy(options={UNIQUE_WAITS: waits}), delay=int(delay))
    except Exception:
        # It may have been applied: a new attempt (that copy is then stale), not a retry, which
        # would have one retry more than the run the key is handed to.
        reschedule(conflict)
    _skip_quietly(conflict)
    service.logger.debug("Rescheduled %s again: it is still in line for run lock %r.", message, key)
    raise Rescheduled(f"run lock {key!r} is held; still in line")


def _skip_quietly(conflict: Conflict) -> None:
    """Mark a rescheduled delivery skipped on purpose: a later copy owns its message's locks."""
    service, _, message, state, key, _ = conflict
    state.keeps_queue_lock = state.quiet_skip = True
    store_nothing(message)
    service.emit("rescheduled", state.spec, key, message)


def stand_in(message: "MessageProxy", state: Delivery, attempt: int) -> None:
    """Make this delivery's retry a third copy of ``attempt`` (a reschedule call's outcome is
    unknown): the first of the three to arrive runs.  Left unclaimed: should Retries give up, its
    dead-letter claims it, so that no other copy runs.
    """
    message.options[UNIQUE_RESCHEDULES] = attempt
    message.options[UNIQUE_VIA] = "retry"
    state.claimed = False


def _conflict_error(conflict: Conflict) -> LockConflict:
    service, _, message, state, key, holder = conflict
    service.emit("conflict", state.spec, key, message, holder)
    holder_id = message_id_of(holder)
    return LockConflict(f"Run lock {key!r} is held by message {holder_id}.", key=key, holder=holder_id)


def raise_conflict(conflict: Conflict) -> NoReturn:
    """Fail the delivery with :class:`LockConflict`: Retries retries it."""
    raise _conflict_error(conflict)


def dead_letter(conflict: Conflict) -> NoReturn:
    """Dead-letter the delivery, and tell a caller waiting on its result."""
    service, broker, message, _, key, _ = conflict
    error = _conflict_error(conflict)
    store_failure(broker, message, error)
    service.logger.warning("Dead-lettering %s: run lock %r is held by message %s.", message, key, error.holder)
    message.fail()
    raise SkipMessage(f"run lock {key!r} is held")


def drop(conflict: Conflict) -> NoReturn:
    """Drop the delivery, and tell a caller waiting on its result."""
    service, broker, message, _, key, _ = conflict
    error = _conflict_error(conflict)
    store_failure(broker, message, error)
    service.logger.warning("Dropping %s: run lock %r is held by message %s.", message, key, error.holder)
    raise SkipMessage(f"run lock {key!r} is held")


#: The server strategies, by name (``model.spec.STRATEGIES["server"]``).
ON_CONFLICT: Mapping[str, Callable[[Conflict], NoReturn]] = {
    "reschedule": reschedule,
    "log": drop,
    "raise": raise_conflict,
    "reject": dead_letter,
}


def skip_copy(
    service: LockContext,
    message: "MessageProxy",
    state: Delivery,
    verdict: CopyVerdict,
    duplicate_of: Optional[str] = None,
) -> NoReturn:
    """Skip a copy that another copy stands for; at INFO for a duplicate of a run that
    succeeded, naming it: the one skip that may be an operator's replay.
    """
    state.keeps_queue_lock = state.quiet_skip = True  # the copy that runs owns the message's locks
    store_nothing(message)
    reason = SKIP_REASONS[verdict]
    key = service.key(state.spec, state.digest, "run")
    service.emit("skipped", state.spec, key, message, duplicate_of, reason=verdict.value)
    if verdict is CopyVerdict.DONE:
        service.logger.info(
            "Skipped %s: it duplicates run %s of message %s, which succeeded (lock %r).",
            message,
            duplicate_of or "?",
            message.message_id,
            key,
        )
    else:
        service.logger.debug("Skipped %s: %s.", message, reason)
    raise CopySkipped(f"skipped: {reason}")


def _line_factor(ahead: int) -> int:
    """How many reschedule delays a waiter's first delayed copy waits, with ``ahead`` ahead."""
    factor = 1
    while ahead > LINE_STEP * factor and factor < MAX_BACKOFF:
        factor *= 2
    return factor


def skip_if_superseded(service: LockContext, broker: "Broker", message: "MessageProxy", state: Delivery) -> None:
    """Skip this delivery (``SkipMessage``: not retried; its result is a :class:`Superseded`) when a newer
    send superseded its message; else mark it started: a later send leaves it running, a new debounce burst.
    """
    spec = state.spec
    if spec.client != "replace" or state.queue_released:  # an unstamped message took no lock to lose
        return
    key = service.key(spec, state.digest, "queue")
    try:
        status, by = NewestWins.require(service.locks, feature="on_conflict='replace'").current(key, message.message_id)
    except Exception as e:
        error = service.backend_error("check whether it was superseded", key, spec, message, e)
        if service.settings.on_backend_error == "run_unlocked":
            service.logger.warning("Running %s without its lock %r.", message, key)
            return
        raise error from e
    if status is not CurrentStatus.SUPERSEDED or by is None:
        return
    # Its slot (a started holder's retry) went with the check; the replacer's is not its to release.
    state.queue_released = True
    state.quiet_skip = True
    _withdraw_waiter(service, message, state)
    service.emit("superseded", spec, key, message, by)
    service.logger.info("Skipped %s: message %s superseded it (lock %r).", message, by, key)
    why = Superseded(f"Message {message.message_id} was superseded by message {by}.", key=key, by=by)
    store_failure(broker, message, why)
    raise SkipMessage(f"superseded by message {by}")


def _withdraw_waiter(service: LockContext, message: "MessageProxy", state: Delivery) -> None:
    """Claim a superseded reschedule's attempt: its waiter leaves the line, never handed the key."""
    if not message.options.get(UNIQUE_RESCHEDULES) or not state.spec.lock.run_lock:
        return
    key = service.key(state.spec, state.digest, "run")
    try:
        _reschedules(service, "a rescheduled message").claim(copy_of(message, key))
    except Exception as e:
        service.backend_error("withdraw the waiter of", key, state.spec, message, e)


_install_mutex = threading.Lock()


class QuietSkips(logging.Filter):
    """Drops ``"Message %s was skipped."`` records of messages marked ``quiet_skip``."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != SKIPPED_MESSAGE_LOG or not isinstance(record.args, tuple) or not record.args:
            return True
        state = delivery(cast("MessageProxy", record.args[0]))
        return state is None or not state.quiet_skip


def install() -> QuietSkips:
    """Add a :class:`QuietSkips` to Dramatiq's worker-thread logger, once per process."""
    logger = logging.getLogger(WORKER_THREAD_LOGGER)
    with _install_mutex:
        for existing in logger.filters:
            if isinstance(existing, QuietSkips):
                return existing
        quiet = QuietSkips()
        logger.addFilter(quiet)
        return quiet
