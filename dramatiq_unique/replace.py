"""Newest wins: ``on_conflict="replace"`` and trailing-edge ``debounce``.

Nothing is deleted from a queue.  A replacing send makes itself the
current holder of the enqueue lock in one round trip and records the
message it superseded (``replace.lua``).  Every later copy of the
superseded message (the original, a retry, a delay-queue move, a
redelivery, a reschedule or hand-off copy) is skipped when a worker
delivers it (``current.lua``).  That needs no scan of a queue, works on
any broker, and touches one digest's keys only.

``debounce`` is replace plus a delay: each send is due ``debounce`` ms
later, so only the newest of a burst is still current when it comes
due; ``debounce_max`` caps the delay at that long after the burst's
first send, which the lock records.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from dramatiq.common import current_millis
from dramatiq.middleware import MiddlewareError, SkipMessage

from .backend import CurrentStatus, ReplaceStatus
from .context import EnqueueLocks, LockService, is_fresh
from .delivery import Delivery, copy_of
from .errors import Superseded
from .results import store_failure
from .spec import ActorSpec

if TYPE_CHECKING:
    from dramatiq import Broker
    from dramatiq.broker import MessageProxy

def debounce_delay(service: LockService, message: Any, delay: Optional[int]) -> Optional[int]:
    """The delay to enqueue ``message`` with: for a new send of a
    debounced actor, at least its quiet window, so that the broker puts
    it on the delay queue; ``before_enqueue`` then sets its due time.
    """
    spec = service.specs.get(message.actor_name)
    if spec is None or spec.debounce is None or not service.enabled or not is_fresh(message):
        return delay
    return max(delay or 0, spec.debounce)


def take(locks: EnqueueLocks, message: Any, delay: Optional[int], spec: ActorSpec, fresh: bool) -> None:
    """Take the enqueue lock of a message of a replacing actor: a new
    send replaces the current holder; a re-enqueue re-enters, unless its
    message was superseded.
    """
    service = locks.service
    key = service.key(spec, message.options["unique_digest"], "queue")
    ttl = service.enqueue_ttl(spec, delay)
    try:
        if fresh:
            _replace(locks, message, delay, spec, key, ttl)
        else:
            _reenter(locks, message, spec, key, ttl)
    except MiddlewareError:  # a refused duplicate
        raise
    except Exception as e:
        locks.take_failed(message, spec, key, fresh, e)


def _replace(locks: EnqueueLocks, message: Any, delay: Optional[int], spec: ActorSpec, key: str, ttl: int) -> None:
    service = locks.service
    recorded = locks.lock_args(message, spec, True)
    got = service.backend.replace(  # type: ignore[union-attr]
        key,
        message.message_id,
        ttl=ttl,
        lock=spec.lock.name,
        lock_args=recorded,
        # until_expired runs a key at most once per lock_ttl: once its
        # holder has started, a new send is a duplicate.
        keep_started=spec.lock.queue_release == "expiry",
        debounce=spec.debounce or 0,
        debounce_max=spec.debounce_max or 0,
        superseded_ttl=ttl,
        where=locks.where(message),
    )
    if got.status is ReplaceStatus.REFUSED:
        locks.refuse(message, spec, key, got.holder)
    if got.status is ReplaceStatus.REENTERED:
        return
    locks.locked(message, spec, key)
    if got.status is ReplaceStatus.REPLACED and got.holder is not None:
        message.options["unique_replaced"] = got.holder
        service.logger.debug("Message %s replaced message %s as holder of %r.", message.message_id, got.holder, key)
    if spec.debounce is not None and "eta" in message.options and (delay or 0) <= spec.debounce:
        # The broker set eta from the full window; the lock knows the burst.
        message.options["eta"] = current_millis() + got.delay


def _reenter(locks: EnqueueLocks, message: Any, spec: ActorSpec, key: str, ttl: int) -> None:
    service = locks.service
    # A copy of a reschedule that may not run must not take the lock back (see Copy).
    run_key = service.key(spec, message.options["unique_digest"], "run")
    copy = copy_of(message, run_key) if spec.lock.run_lock else None
    status, other = service.backend.current(  # type: ignore[union-attr]
        key, message.message_id, reenter=True, ttl=ttl, lock=spec.lock.name, copy=copy, where=locks.where(message)
    )
    # SUPERSEDED goes on and is skipped when delivered: raising would
    # lose or strand a delay-queue move; REENTERED holds what it held.
    if status is CurrentStatus.MAY_NOT_RUN:
        service.logger.debug("Re-enqueued %s without its lock %r: %s.", message, key, other)
    elif status is CurrentStatus.CURRENT:
        locks.locked(message, spec, key)
    elif status is CurrentStatus.LAPSED:
        locks.lapsed(message, spec, key, other)


def restore(service: LockService, message: Any, taken: list[tuple[str, str]]) -> None:
    """After a failed publish, make the message that this send superseded
    current again, so that it runs; the guard then releases this send's
    own slot.  A backend failure here leaves the superseded message
    superseded, as the send's error tells its caller.
    """
    spec = service.specs.get(message.actor_name)
    if spec is None or spec.client != "replace":
        return
    for key, owner in taken:
        try:
            previous = service.backend.unreplace(key, owner)  # type: ignore[union-attr]
        except Exception as e:
            service.backend_error("restore the message superseded by an unsent one in", key, spec, message, e)
            continue
        if previous is not None:
            service.logger.info(
                "Message %s is current again in %r: its replacement was not enqueued.", previous, key
            )


def skip_if_superseded(
    service: LockService, broker: "Broker", message: "MessageProxy", state: Delivery
) -> None:
    """Skip this delivery when a newer send superseded its message; else
    mark the message as started, so that a send from now on leaves it
    running and opens a new debounce burst.

    A superseded message is not run and not retried, and a caller
    waiting on its result gets a ``ResultFailure`` naming
    :class:`Superseded` and the message that replaced it.

    Raises:
      SkipMessage: when superseded.
    """
    spec = state.spec
    if spec.client != "replace" or state.queue_released:  # an unstamped message took no lock to lose
        return
    key = service.key(spec, state.digest, "queue")
    try:
        status, by = service.backend.current(key, message.message_id)  # type: ignore[union-attr]
    except Exception as e:
        error = service.backend_error("check whether it was superseded", key, spec, message, e)
        if service.settings.on_backend_error == "run_unlocked":
            service.logger.warning("Running %s without its lock %r.", message, key)
            return
        raise error from e
    if status is not CurrentStatus.SUPERSEDED or by is None:
        return
    # The slot it may have kept (a started holder's retry) went with the
    # check; the replacing message's slot is never its to release.
    state.queue_released = True
    state.quiet_skip = True
    _withdraw_waiter(service, message, state)
    service.emit("superseded", spec, key, message, by)
    service.logger.info("Skipped %s: message %s superseded it (lock %r).", message, by, key)
    why = Superseded(f"Message {message.message_id} was superseded by message {by}.", key=key, by=by)
    store_failure(broker, message, why)
    raise SkipMessage(f"superseded by message {by}")


def _withdraw_waiter(service: LockService, message: "MessageProxy", state: Delivery) -> None:
    """A copy of a rescheduled, superseded message claims its attempt,
    which takes its waiter off the run lock, so that the key is never
    handed to it.
    """
    if not message.options.get("unique_reschedules") or not state.spec.lock.run_lock:
        return
    key = service.key(state.spec, state.digest, "run")
    try:
        service.backend.claim(copy_of(message, key))  # type: ignore[union-attr]
    except Exception as e:
        service.backend_error("withdraw the waiter of", key, state.spec, message, e)

