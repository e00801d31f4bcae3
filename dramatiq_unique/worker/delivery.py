"""Per-delivery state, and the fencing token of the running message.

Which copy of its message a delivery is, and where it stands among its
key's waiters, is :mod:`..send.copies`: the send side stamps both.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

from ..model.spec import ActorSpec
from .coroutines import CoroutineWatch
from .leases import Lease

if TYPE_CHECKING:
    from dramatiq import Broker
    from dramatiq.broker import MessageProxy

_fence: ContextVar[Optional[int]] = ContextVar("dramatiq_unique_fence", default=None)


@dataclass(eq=False)
class Delivery:
    """What the middleware did for one delivery of a message.  It lives
    on the ``MessageProxy``, never in ``message.options``: Retries
    copies options into the retried message.
    """

    spec: ActorSpec
    digest: str
    run_key: Optional[str] = None
    run_owner: Optional[str] = None
    #: The backend confirmed the run lock: a release that finds it gone
    #: reports it lost.  A call whose reply was lost may have taken it
    #: unconfirmed; the release then cleans up without a report.
    run_confirmed: bool = False
    #: This copy settled its claim (see ``Copy``): it is the one that runs.
    claimed: bool = False
    #: For an async actor: whether its coroutine has really ended.
    coroutine: Optional[CoroutineWatch] = None
    lease: Optional[Lease] = None
    fence: Optional[int] = None
    keeps_queue_lock: bool = False
    queue_released: bool = False
    #: The middleware itself skipped this delivery on purpose (a
    #: reschedule, a copy that lost its claim): Dramatiq's WARNING
    #: "Message ... was skipped." says nothing an operator needs.
    quiet_skip: bool = False


class LockToRelease(NamedTuple):
    """What reporting the release of one lock of a delivery needs, on
    whichever thread its outcome arrives.
    """

    #: Where a waiter the release hands the key to is enqueued; None for
    #: an enqueue lock, which hands nothing over.
    broker: Optional["Broker"]
    message: Any
    spec: ActorSpec
    key: str
    owner: str
    lease: Optional[Lease] = None
    #: The backend confirmed the run lock: a release that finds it gone reports it lost.
    confirmed: bool = False
    #: The run succeeded: its release finishes its message.
    succeeded: bool = False


class HandOff(NamedTuple):
    """A run lock's key that a release handed to its longest waiter: the
    waiter's encoded copy, to enqueue off the worker thread.
    """

    broker: "Broker"
    key: str
    encoded: bytes


def delivery(message: "MessageProxy") -> Optional[Delivery]:
    """The middleware's state for ``message``, if it has any."""
    return getattr(message, "_unique_delivery", None)


def attach(message: "MessageProxy", state: Delivery) -> Delivery:
    message._unique_delivery = state  # type: ignore[attr-defined]
    return state


def fence_token(message: Any = None) -> Optional[int]:
    """The fencing token of the run lock held for the current message,
    or for ``message`` when given.

    The token grows every time a new holder takes the key.  Pass it to
    the system you write to and have it refuse writes carrying a token
    lower than one it has seen; that keeps a paused or partitioned
    holder whose lease ran out from overwriting newer work.

    Returns:
      int: or None when no run lock is held.
    """
    if message is None:
        return _fence.get()
    state = delivery(message)
    return state.fence if state is not None else None


#: Sets the fencing token of the running message: the context
#: variable's own method, so that a job's two calls run no Python.
set_fence = _fence.set
