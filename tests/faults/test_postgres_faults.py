"""Locks in PostgreSQL with real workers: a SIGKILLed holder frees its
key within one lease, and a PostgreSQL that goes down fails lock calls
closed, then serves them again once it is back.

The broker stays up on the suite's Redis (or RabbitMQ); only the
PostgreSQL that holds the locks is touched.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

import pytest

from dramatiq_unique import LockBackendError
from tests.conftest import free_port, wait_for
from tests.faults import test_crash
from tests.faults.harness import Harness, overlaps
from tests.postgres_server import PostgresServer


@pytest.fixture
def pg_harness(make_harness: Callable[..., Harness], postgres_url: str) -> Callable[..., Harness]:
    """``make_harness`` with the locks in the suite's PostgreSQL."""
    return lambda broker="redis", **env: make_harness(broker, FAULTS_LOCK_URL=postgres_url, **env)


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_a_killed_holder_frees_its_postgres_lock_within_one_lease(pg_harness, figure, broker):
    test_crash.test_a_killed_while_executing_holder_frees_its_key_within_one_lease(pg_harness, figure, broker)


@pytest.fixture
def lock_postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL for locks only, that the test may stop and start."""
    server = PostgresServer(free_port())
    server.start()
    yield server
    server.remove()


def test_locks_fail_closed_while_their_postgres_is_down(make_harness, lock_postgres, figure):
    # Given workers whose locks live in a PostgreSQL of their own, and a job holding a key
    h = make_harness("redis", FAULTS_LOCK_URL=lock_postgres.url, FAULTS_SOCKET_TIMEOUT="2")
    h.workers(processes=1, threads=2)
    holder = h.app.hold.send("k", gate="holder")
    h.started(holder.message_id)
    in_flight = h.queued()
    # When that PostgreSQL stops mid-run
    lock_postgres.stop("immediate")
    down_at = time.time()
    # Then send() with a client lock raises an error naming the lock backend, and enqueues nothing
    with pytest.raises(LockBackendError) as refused:
        h.app.once.send("c")
    assert "PostgresBackend(postgresql://postgres@127.0.0.1" in str(refused.value)
    assert h.queued() == in_flight
    # And a message whose run lock cannot be taken is not run but retried by Dramatiq
    waiting = h.app.hold.send("other")
    wait_for(lambda: attempts(h, waiting.message_id) >= 2, timeout=60, what="two failed attempts to take the lock")
    h.open_gate("holder")
    assert waiting.message_id not in [r.message_id for r in h.starts()]
    # And once PostgreSQL is back, it runs, once
    # (From when the server is asked to start: a worker may take the lock
    # as soon as it accepts connections, before start() has returned.)
    up_at = time.time()
    lock_postgres.start()
    run = h.finished(waiting.message_id, timeout=60)
    h.finished(holder.message_id, timeout=60)
    wait_for(lambda: h.queued() == 0, timeout=30, what="nothing left in flight")
    started_while_down = [r for r in h.starts() if down_at <= r.start < up_at]
    figure("runs_started_while_down", len(started_while_down))
    figure("resumed_after_s", round(run.start - up_at, 3))
    assert started_while_down == []
    assert run.start >= up_at and isinstance(run.fence, int)
    assert [r.message_id for r in h.runs()].count(waiting.message_id) == 1
    # And locks serialize a key again
    sent = [h.app.hold.send("k2", seconds=0.1) for _ in range(3)]
    after = [h.finished(m.message_id, timeout=60) for m in sent]
    assert overlaps(after) == []


def attempts(h, message_id):
    return sum(1 for e in h.events("backend_error") if e["message_id"] == message_id)
