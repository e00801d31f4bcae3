"""The lock types and conflict strategies, as data.

Every lock type is one row of :data:`LOCK_TYPES`: whether it takes a
queue lock when the message is enqueued (owned by the message id),
whether it takes a run lock around the actor (owned by a token per
execution, kept alive as a lease), and when the queue lock is released.
The middleware reads these rows; there is no class per lock type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping, Optional, Union

from ..errors import ConfigurationError

#: When a queue lock is released: just before the actor runs, after it
#: has finished for good, or only when it expires.
QueueRelease = Literal["run_start", "run_end", "expiry"]


@dataclass(frozen=True)
class LockType:
    """One row of the lock table."""

    name: str
    queue_lock: bool
    run_lock: bool
    queue_release: Optional[QueueRelease]

    @property
    def sides(self) -> tuple[str, ...]:
        """The conflict sides this lock type has."""
        return tuple(side for side, has in (("client", self.queue_lock), ("server", self.run_lock)) if has)


LOCK_TYPES: Mapping[str, LockType] = {
    lock.name: lock
    for lock in (
        LockType("until_executing", queue_lock=True, run_lock=False, queue_release="run_start"),
        LockType("until_executed", queue_lock=True, run_lock=False, queue_release="run_end"),
        LockType("until_expired", queue_lock=True, run_lock=False, queue_release="expiry"),
        LockType("while_executing", queue_lock=False, run_lock=True, queue_release=None),
        LockType("until_and_while_executing", queue_lock=True, run_lock=True, queue_release="run_start"),
    )
}

#: Valid strategies per side, the default first.  The client strategy
#: ``replace`` makes a new send the holder of the enqueue lock and
#: supersedes the message that held it (see :mod:`dramatiq_unique.send.replace`).
STRATEGIES: Mapping[str, tuple[str, ...]] = {
    "client": ("log", "raise", "replace"),
    "server": ("reschedule", "log", "raise", "reject"),
}

OnConflict = Union[str, Mapping[str, str]]


def lock_type(name: object) -> LockType:
    """Look a lock type up by name.

    Raises:
      ConfigurationError: listing the valid names.
    """
    if not isinstance(name, str) or name not in LOCK_TYPES:
        raise ConfigurationError(f"lock={name!r} is not a lock type. Valid choices: {', '.join(LOCK_TYPES)}.")
    return LOCK_TYPES[name]


def strategies(lock: LockType, on_conflict: Optional[OnConflict]) -> dict[str, str]:
    """Resolve ``on_conflict`` into one strategy per side of ``lock``.

    A plain name applies to every side the lock type has, so it must be
    valid on each of them, except ``"replace"``, which only a client
    side has; a ``{"client": ..., "server": ...}`` mapping
    names sides explicitly.

    Raises:
      ConfigurationError: for an unknown name or a side the lock type
        does not have, listing the valid choices.
    """
    chosen = {side: STRATEGIES[side][0] for side in lock.sides}
    if on_conflict is None:
        return chosen
    if on_conflict == "replace" and not lock.queue_lock:
        raise ConfigurationError(
            f"on_conflict='replace' needs a lock type with an enqueue lock "
            f"({', '.join(n for n, t in LOCK_TYPES.items() if t.queue_lock)}), not lock={lock.name!r}."
        )
    if on_conflict == "replace":
        # Only the client side can replace; the server side keeps its default.
        given = {"client": "replace"}
    elif isinstance(on_conflict, str):
        given = {side: on_conflict for side in lock.sides}
    elif isinstance(on_conflict, Mapping):
        given = dict(on_conflict)
    else:
        raise ConfigurationError(
            f"on_conflict={on_conflict!r} is invalid: expected a strategy name or {{'client': ..., 'server': ...}}."
        )
    for side, name in given.items():
        if side not in lock.sides:
            raise ConfigurationError(
                f"on_conflict side {side!r} does not apply to lock={lock.name!r}. "
                f"Valid sides: {', '.join(lock.sides)}."
            )
        if name not in STRATEGIES[side]:
            raise ConfigurationError(
                f"on_conflict={name!r} is not a {side} strategy for lock={lock.name!r}. "
                f"Valid {side} choices: {', '.join(STRATEGIES[side])}"
                + (". Give one per side as {'client': ..., 'server': ...}." if len(lock.sides) > 1 else ".")
            )
        chosen[side] = name
    return chosen
