"""Per-delivery state, and the fencing token of the running message."""

from __future__ import annotations

import threading
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from .backend import SENDS_PER_MS, Copy
from .coroutines import CoroutineWatch
from .leases import Lease
from .spec import ActorSpec

if TYPE_CHECKING:
    from dramatiq.broker import MessageProxy

_fence: ContextVar[Optional[int]] = ContextVar("dramatiq_unique_fence", default=None)


class _SendOrder:
    """The place of each send among this process's sends of the same
    millisecond: waiters of one key are handed the key in send order,
    and message ids, the only other tie-breaker, are random.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ms, self._next = -1, 0

    def stamp(self, message: Any) -> None:
        """Stamp ``unique_seq`` on a new message (never on a re-enqueue:
        a retry or a move keeps its place).
        """
        ms = int(message.message_timestamp)
        with self._lock:
            if ms != self._ms:
                self._ms, self._next = ms, 0
            seq, self._next = self._next, self._next + 1
        message.options["unique_seq"] = min(seq, SENDS_PER_MS - 1)


#: Stamps the send order of this process's new messages.
send_sequence = _SendOrder()


def send_order(message: Any) -> int:
    """Where a waiting message stands among its key's waiters: the
    millisecond its message was made, then its place among its
    producer's messages of that millisecond.
    """
    return int(message.message_timestamp) * SENDS_PER_MS + int(message.options.get("unique_seq", 0))


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


def message_id_of(owner: Optional[str]) -> Optional[str]:
    """The message id in a lock owner: a message id itself (enqueue
    locks) or ``<message id>/<token>`` (run locks).
    """
    return owner.split("/")[0] if owner else None


def copy_of(message: Any, key: str) -> Copy:
    """Which copy of its message ``message`` is, for the run lock ``key``."""
    options = message.options
    # Built in C (every job makes one): a named tuple's own constructor runs Python.
    fields = (
        key,
        message.message_id,
        options.get("unique_reschedules", 0),
        options.get("unique_via", ""),
        options.get("unique_lock_args"),  # stamped at send under record_lock_args only
        options.get("retries", 0),
    )
    return tuple.__new__(Copy, fields)


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
