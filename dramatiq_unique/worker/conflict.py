"""What a delivery does when its run lock is held: the actor's server
strategy, looked up in :data:`ON_CONFLICT`.

``reschedule`` registers the delivery as a waiter, so that the holder's
release hands the key over at once, and re-enqueues it with a delay as
a fallback.  Of its copies (and of the retry of the delivery, when a
call of the reschedule failed after it may have been applied), the
first to arrive wins; the others, and every stale copy, are skipped
(:func:`skip_copy`).  ``docs/reliability.md``, "The hand-off model", has
the rules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping, NamedTuple, NoReturn, Optional

from dramatiq.middleware import SkipMessage

from ..backends.base import Copy, CopyVerdict, Reschedules
from ..background import JITTER
from ..errors import CopySkipped, LockConflict, Rescheduled
from ..model.spec import ActorSpec
from ..model.wire import UNIQUE_DIGEST, UNIQUE_RESCHEDULES, UNIQUE_VIA, UNIQUE_WAITS, message_id_of
from ..send.context import LockContext
from ..send.copies import send_order
from ..send.results import store_failure, store_nothing
from .delivery import Delivery

if TYPE_CHECKING:
    from dramatiq import Broker
    from dramatiq.broker import MessageProxy

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


class Conflict(NamedTuple):
    """A delivery that found its run lock held."""

    service: LockContext
    broker: "Broker"
    message: "MessageProxy"
    state: Delivery
    key: str
    holder: Optional[str]


def reschedule_delay(service: LockContext, spec: ActorSpec) -> int:
    """The delay of a rescheduled copy of ``spec``'s messages, in ms."""
    return spec.reschedule_delay if spec.reschedule_delay is not None else service.settings.reschedule_delay


def reserve(service: LockContext, spec: ActorSpec) -> int:
    """How long a slot handed to a waiter of ``spec`` stays reserved for
    it, in milliseconds.
    """
    return RESERVE_DELAYS * reschedule_delay(service, spec) + RESERVE_SLACK


def on_conflict(conflict: Conflict) -> NoReturn:
    """Do what the actor's server strategy says."""
    strategy = conflict.state.spec.server
    ON_CONFLICT[strategy if strategy is not None else "log"](conflict)
    raise AssertionError(f"strategy {strategy!r} returned")  # pragma: no cover: every strategy raises


def reschedule(conflict: Conflict) -> NoReturn:
    """Register a hand-off copy as a waiter, then enqueue a delayed copy."""
    service, broker, message, state, key, _ = conflict
    spec = state.spec
    attempt = message.options.get(UNIQUE_RESCHEDULES, 0) + 1
    options = {UNIQUE_RESCHEDULES: attempt, UNIQUE_DIGEST: state.digest, UNIQUE_WAITS: 0}
    # Register before enqueueing: a delayed copy that arrived first
    # would find no record, and the hand-off would run it again.
    try:
        handed = message.copy(options={**options, UNIQUE_VIA: "handoff"})
        waiting = Copy(key, message.message_id, attempt, "handoff")
        order, ttl = send_order(message), service.settings.lock_ttl
        rescheduling = Reschedules.require(service.locks, feature="on_conflict='reschedule'")
        ahead = rescheduling.join_line(waiting, handed.encode(), order=order, ttl=ttl)
    except Exception as e:
        # It may have been applied: a hand-off copy of the attempt may come.
        stand_in(message, state, attempt)
        raise service.backend_error("register a message waiting for", key, spec, message, e) from e
    try:
        delayed = message.copy(options={**options, UNIQUE_VIA: "delay"})
        # (a backend written against the older wait, which returned None, has no line to tell)
        factor = _line_factor(ahead if isinstance(ahead, int) else 0)
        broker.enqueue(delayed, delay=int(reschedule_delay(service, spec) * factor * JITTER.uniform(0.8, 1.2)))
    except Exception as e:
        # It may have been applied: the delayed copy may be queued.
        stand_in(message, state, attempt)
        raise service.backend_error("reschedule a message waiting for", key, spec, message, e) from e
    _skip_quietly(conflict)
    service.logger.debug("Rescheduled %s: run lock %r is held.", message, key)
    raise Rescheduled(f"run lock {key!r} is held; rescheduled")


def wait_longer(conflict: Conflict, free_in: Optional[int]) -> NoReturn:
    """A delayed copy came back while its message is still in line: the
    backend changed nothing, and it only comes back later, each time
    twice as late (at most ``MAX_BACKOFF`` delays), but no later than
    just after the key's holder runs out (``free_in``), should it die:
    then the first copy to arrive hands the key to the oldest waiter.
    Should the enqueue fail, it is rescheduled as a new attempt.
    """
    service, broker, message, state, key, _ = conflict
    waits = message.options.get(UNIQUE_WAITS, 0) + 1
    base = reschedule_delay(service, state.spec)
    delay = base * min(2**waits, MAX_BACKOFF) * JITTER.uniform(0.8, 1.2)
    if free_in is not None and free_in >= 0:
        delay = min(delay, free_in + base * JITTER.uniform(0.05, 0.25))
    try:
        broker.enqueue(message.copy(options={UNIQUE_WAITS: waits}), delay=int(delay))
    except Exception:
        # It may have been applied.  A retry of this very copy would have one retry more than
        # the run that the key is handed to, and run after it: reschedule anew instead, as a
        # new attempt (the possibly queued copy is then stale), with its own stand-in.
        reschedule(conflict)
    _skip_quietly(conflict)
    service.logger.debug("Rescheduled %s again: it is still in line for run lock %r.", message, key)
    raise Rescheduled(f"run lock {key!r} is held; still in line")


def _skip_quietly(conflict: Conflict) -> None:
    """Mark a rescheduled delivery as skipped on purpose: a copy of it
    runs later, and owns its message's locks.
    """
    service, _, message, state, key, _ = conflict
    state.keeps_queue_lock = state.quiet_skip = True
    store_nothing(message)
    service.emit("rescheduled", state.spec, key, message)


def stand_in(message: "MessageProxy", state: Delivery, attempt: int) -> None:
    """Make this delivery's retry a third copy of ``attempt``, after a
    call of the reschedule whose outcome is unknown: the delayed and the
    hand-off copy may or may not exist, and of the three the first to
    arrive runs and the others are skipped (Retries re-enqueues this
    very message, with these options).  Should Retries give up instead,
    this copy of the attempt is unclaimed: its dead-letter claims it, so
    that no other copy runs.
    """
    message.options[UNIQUE_RESCHEDULES] = attempt
    message.options[UNIQUE_VIA] = "retry"
    state.claimed = False


def _conflict_error(conflict: Conflict) -> LockConflict:
    """Tell the conflict, and the error that says it."""
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


#: The server strategies, by name (``model.locks.STRATEGIES["server"]``).
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
    """Skip a copy of a message that another copy of it stands for.  A
    duplicate of a run that succeeded is said at INFO, naming that run:
    it is the one skip of a message that may be an operator's replay.
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
    """How many reschedule delays the first delayed copy of a waiter
    with ``ahead`` waiters ahead of it waits.
    """
    factor = 1
    while ahead > LINE_STEP * factor and factor < MAX_BACKOFF:
        factor *= 2
    return factor
