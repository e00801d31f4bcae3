"""Newest wins: ``on_conflict="replace"`` and trailing-edge ``debounce``.

Nothing is deleted from a queue.  A replacing send makes itself the
current holder of the enqueue lock in one round trip and records the
message it superseded (``replace.lua``).  Every later copy of the
superseded message (the original, a retry, a delay-queue move, a
redelivery, a reschedule or hand-off copy) is skipped when a worker
delivers it (``current.lua``, read by :mod:`..worker.take`).  That needs no scan of a queue, works on
any broker, and touches one digest's keys only.

``debounce`` is replace plus a delay: each send is due ``debounce`` ms
later, so only the newest of a burst is still current when it comes
due; ``debounce_max`` caps the delay at that long after the burst's
first send, which the lock records.
"""

from __future__ import annotations

from typing import Any, Optional

from dramatiq.common import current_millis
from dramatiq.middleware import MiddlewareError

from ..backends.base import CurrentStatus, NewestWins, ReplaceStatus
from ..model.spec import ActorSpec
from ..model.wire import QUEUE, RUN, UNIQUE_DIGEST, UNIQUE_REPLACED
from .context import EnqueueLocks, LockContext, is_fresh
from .copies import copy_of

def debounce_delay(service: LockContext, message: Any, delay: Optional[int]) -> Optional[int]:
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
    key = service.key(spec, message.options[UNIQUE_DIGEST], QUEUE)
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
    got = NewestWins.require(service.locks, feature="on_conflict='replace'").replace(
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
        message.options[UNIQUE_REPLACED] = got.holder
        service.logger.debug("Message %s replaced message %s as holder of %r.", message.message_id, got.holder, key)
    if spec.debounce is not None and "eta" in message.options and (delay or 0) <= spec.debounce:
        # The broker set eta from the full window; the lock knows the burst.
        message.options["eta"] = current_millis() + got.delay


def _reenter(locks: EnqueueLocks, message: Any, spec: ActorSpec, key: str, ttl: int) -> None:
    service = locks.service
    # A copy of a reschedule that may not run must not take the lock back (see Copy).
    run_key = service.key(spec, message.options[UNIQUE_DIGEST], RUN)
    copy = copy_of(message, run_key) if spec.lock.run_lock else None
    status, other = NewestWins.require(service.locks, feature="on_conflict='replace'").current(
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


def restore(service: LockContext, message: Any, taken: list[tuple[str, str]]) -> None:
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
            previous = NewestWins.require(service.locks, feature="on_conflict='replace'").unreplace(key, owner)
        except Exception as e:
            service.backend_error("restore the message superseded by an unsent one in", key, spec, message, e)
            continue
        if previous is not None:
            service.logger.info(
                "Message %s is current again in %r: its replacement was not enqueued.", previous, key
            )
