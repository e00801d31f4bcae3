"""A delivery of a superseded message is skipped, not run.

The send side's ``on_conflict="replace"`` and ``debounce``
(:mod:`..send.replace`) make the newest send the current holder of the
enqueue lock; here each delivery of a replace actor asks whether its
message is still current before it runs (``current.lua``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dramatiq.middleware import SkipMessage

from ..backends.capabilities import NewestWins, Reschedules
from ..backends.records import CurrentStatus
from ..errors import Superseded
from ..model.wire import UNIQUE_RESCHEDULES
from ..send.context import LockContext, copy_of, store_failure
from .delivery import Delivery

if TYPE_CHECKING:
    from dramatiq import Broker
    from dramatiq.broker import MessageProxy


def skip_if_superseded(
    service: LockContext, broker: "Broker", message: "MessageProxy", state: Delivery
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
        status, by = NewestWins.require(service.locks, feature="on_conflict='replace'").current(key, message.message_id)
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


def _withdraw_waiter(service: LockContext, message: "MessageProxy", state: Delivery) -> None:
    """A copy of a rescheduled, superseded message claims its attempt,
    which takes its waiter off the run lock, so that the key is never
    handed to it.
    """
    if not message.options.get(UNIQUE_RESCHEDULES) or not state.spec.lock.run_lock:
        return
    key = service.key(state.spec, state.digest, "run")
    try:
        Reschedules.require(service.locks, feature="a rescheduled message").claim(copy_of(message, key))
    except Exception as e:
        service.backend_error("withdraw the waiter of", key, state.spec, message, e)

