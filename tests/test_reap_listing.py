"""A worker's periodic reaper lists the enqueue locks through the
backends' shared listing (``PrefixLocks``, below the operators' side),
as the operators' ``LockAdmin`` does: it must see what ``LockAdmin``
sees, and fail as it words it.
"""

from __future__ import annotations

import uuid
from typing import Any, Iterator

import pytest

from dramatiq_unique import LockBackendError, StubBackend
from dramatiq_unique.backends.base import PrefixLocks
from dramatiq_unique.ops.admin import LockAdmin

MINUTE = 60_000


@pytest.fixture(params=["stub", "redis"])
def backend(request: pytest.FixtureRequest) -> Any:
    return StubBackend() if request.param == "stub" else request.getfixturevalue("redis_backend")


def seen(locks: Iterator[Any]) -> list[tuple[Any, ...]]:
    """What the reaper reads of each listed lock."""
    return sorted(
        (lock.key, lock.actor, lock.lock, lock.lock_args, tuple((h.owner, h.record) for h in lock.holders))
        for lock in locks
    )


@pytest.mark.parametrize("name", ["plain", "odd*[?]"])
def test_the_workers_listing_is_the_operators_listing_of_enqueue_locks(backend: Any, name: str) -> None:
    # Given, under a prefix (with glob characters in the second case), enqueue locks of two actors,
    # one with two holders, a run lock, and a lock under a prefix that the first one's glob also matches
    prefix = f"{name}-{uuid.uuid4().hex[:8]}"
    digest, other = "a" * 32, "b" * 32
    where = "ns\tdefault\tr1"
    backend.acquire(f"{prefix}:one:{{{digest}}}:queue", "m1", ttl=MINUTE, limit=2, lock="until_executed",
                    lock_args="[1]", where=where)
    backend.acquire(f"{prefix}:one:{{{digest}}}:queue", "m2", ttl=2 * MINUTE, limit=2, lock="until_executed",
                    where=where)
    backend.acquire(f"{prefix}:two:{{{other}}}:queue", "m3", ttl=MINUTE, lock="until_and_while_executing")
    backend.acquire(f"{prefix}:one:{{{other}}}:run", "m4/t", ttl=MINUTE, lock="while_executing")
    backend.acquire(f"{prefix}x:one:{{{other}}}:queue", "m5", ttl=MINUTE, lock="until_executed")
    admin, listing = LockAdmin(backend, prefix=prefix), PrefixLocks(backend, prefix=prefix)
    # Then the worker lists exactly the enqueue locks the operators list, holders and records alike
    everything = seen(listing.locks(phase="queue"))
    assert everything == seen(admin.locks(phase="queue"))
    assert [key.rsplit(":", 2)[0] for key, *_ in everything] == [f"{prefix}:one", f"{prefix}:two"]
    assert everything[0][4][0][1].where == where  # the records the reaper checks are there
    assert seen(listing.locks(actor="two")) == seen(admin.locks(actor="two", phase="queue"))
    assert seen(listing.locks(phase="run")) == seen(admin.locks(phase="run"))
    assert [lock.key for lock in listing.locks(phase="run")] == [f"{prefix}:one:{{{other}}}:run"]


def test_a_listing_that_fails_says_so_as_the_operators_listing_does() -> None:
    class Down(StubBackend):
        def scan(self, pattern: str) -> Iterator[str]:
            raise ConnectionError("the lock backend is\n unreachable")

    backend = Down()
    errors = []
    for listing in (PrefixLocks(backend, prefix="p"), LockAdmin(backend, prefix="p")):
        with pytest.raises(LockBackendError) as raised:
            next(iter(listing.locks(phase="queue")))
        errors.append(str(raised.value))
    assert errors[0] == errors[1] == f"Lock backend {backend.describe()} failed to scan 'p:*:*:queue': " \
                                     "the lock backend is unreachable"
