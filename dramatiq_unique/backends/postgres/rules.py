"""The stub's rules, run on rows: what one call does to the keys it locked.

A call locks the rows of its keys (:data:`.sql.LOCK`), and
:func:`apply` loads their state into a :class:`~..stub.StubBackend`
made for the call, runs the stub's own method on it with the server's
clock, and says which rows to write back and which to drop.  The rules
of the claim are thus written once, in ``stub.py``, for the stub and
PostgreSQL alike.
"""

from __future__ import annotations

import json
from typing import Any, Callable, NamedTuple, Optional, Sequence, TypeVar

from ..stub import CLOCK, StubBackend
from .state import dump, last_fence, load

T = TypeVar("T")

#: How long a key that holds nothing keeps its last fence, in
#: milliseconds, before the sweep deletes its row: a fence taken later
#: grows from the server's clock in microseconds instead.
DEFAULT_FENCE_MEMORY = 3_600_000

#: A row as the statements return it: key, state (JSON text), clock
#: (server Unix microseconds, as text).
Row = Sequence[Optional[str]]


class Applied(NamedTuple):
    """What a call did.

    Attributes:
      result: What the stub's method returned.
      writes(list): The parameters of :data:`.sql.WRITE` for each row
        that changed: state (JSON), expires at, key.
      deletes(list[str]): The keys whose rows hold nothing, not even a
        fence: rows made for this call.
    """

    result: Any
    writes: list[list[str]]
    deletes: list[str]


def clock_of(rows: Sequence[Row]) -> int:
    """The latest clock the rows carry, in server Unix microseconds."""
    return max(int(row[2]) for row in rows if row[2] is not None)


def loaded(rows: Sequence[Row]) -> tuple[StubBackend, dict[str, dict[str, Any]]]:
    """A stub holding the state of ``rows``, and each row's state by key."""
    stub = StubBackend()
    states = {}
    for key, text, _ in rows:
        if key is None or text is None:
            continue
        states[key] = json.loads(text)
        load(stub, key, states[key])
    return stub, states


def run(rows: Sequence[Row], verb: Callable[[StubBackend], T]) -> T:
    """Run ``verb`` on a stub holding ``rows``, at their clock, and
    return what it returned: for reads, whose changes are not kept.
    """
    stub, _ = loaded(rows)
    token = CLOCK.set(clock_of(rows))
    try:
        return verb(stub)
    finally:
        CLOCK.reset(token)


def apply(rows: Sequence[Row], verb: Callable[[StubBackend], Any], *, fence_memory: int) -> Applied:
    """Run ``verb`` on a stub holding the locked ``rows``, at their
    clock, and say what to write back.
    """
    stub, before = loaded(rows)
    clock = clock_of(rows)
    token = CLOCK.set(clock)
    try:
        result = verb(stub)
        writes, deletes = [], []
        for key, old in before.items():
            state, expires_at = dump(stub, key, fence=last_fence(old))
            if not state:
                deletes.append(key)
            elif state != old:
                expires_at = expires_at or clock // 1000 + fence_memory
                writes.append([json.dumps(state), str(expires_at), key])
    finally:
        CLOCK.reset(token)
    return Applied(result, writes, deletes)
