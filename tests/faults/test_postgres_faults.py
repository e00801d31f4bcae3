"""Locks in PostgreSQL with real workers: a SIGKILLed holder frees its
key within one lease, and a PostgreSQL that goes down fails lock calls
closed, then serves them again once it is back.

The broker stays up on the suite's Redis (or RabbitMQ); only the
PostgreSQL that holds the locks is touched.
"""

from __future__ import annotations

import signal
import time
from typing import Callable, Iterator

import pytest

from dramatiq_unique import LockBackendError
from dramatiq_unique.backends.postgres import PostgresBackend
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



#: How long the restart tests keep PostgreSQL down.
OUTAGE_S = 8.0


def run_four(h, name):
    """Two until_executed and two while_executing jobs, named after a
    group, held at the gate "outage"; wait until all four run.
    """
    batch = [h.app.once.send(f"{name}-u{i}", gate="outage") for i in range(2)]
    batch += [h.app.hold.send(f"{name}-k{i}", gate="outage") for i in range(2)]
    wait_for(lambda: {m.message_id for m in batch} <= {r.message_id for r in h.starts()},
             what=f"the {name} group to run its four jobs")
    return batch


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_every_key_takes_a_new_send_within_one_lease_of_a_postgres_restart(make_harness, lock_postgres, figure, mode):
    # Given two worker groups with a 3 s lease whose locks live in a PostgreSQL of their own,
    # each with every thread busy on until_executed and while_executing jobs (no prefetch beyond them)
    lease = 3.0
    h = make_harness("redis", FAULTS_LOCK_URL=lock_postgres.url, FAULTS_LEASE=str(int(lease * 1000)))
    stopping = h.workers(processes=1, threads=4, dramatiq_queue_prefetch="4")
    sent = run_four(h, "stopping")
    h.workers(processes=1, threads=4, dramatiq_queue_prefetch="4")
    sent += run_four(h, "staying")
    # When PostgreSQL stops, the jobs finish (so their releases fail), and one group is SIGTERMed inside the outage
    lock_postgres.stop(mode)
    down_at = time.monotonic()
    h.open_gate("outage")
    wait_for(lambda: len(h.runs()) == len(sent), what="every job to finish")
    stopping.process.send_signal(signal.SIGTERM)
    asked = time.monotonic()
    assert stopping.process.wait(timeout=30) == 0
    stopped_in = time.monotonic() - asked
    figure("stopped_in_s", round(stopped_in, 3))
    assert stopped_in <= h.app.unique.settings.shutdown_timeout / 1000 + 2  # the package's bound, and Dramatiq's exit
    time.sleep(max(0.0, down_at + OUTAGE_S - time.monotonic()))  # the outage's length is the scenario's
    # And PostgreSQL comes back
    up_at = time.monotonic()
    lock_postgres.start()
    # Then within one lease every key is free again: the until_executed keys, the run locks whose
    # releases failed, and the releases the stopped group owed
    unique = h.app.unique
    keys = []
    for message in sent:
        spec = unique.specs[message.actor_name]
        phase = "queue" if message.actor_name == "once" else "run"
        keys.append(unique.key(spec, spec.digest(message.args[:1], {}), phase))
    probe = PostgresBackend(url=lock_postgres.url)
    try:
        wait_for(lambda: all(probe.inspect(key) is None for key in keys), timeout=60, what="every key to be free")
    finally:
        probe.close()
    freed_after = time.monotonic() - up_at
    figure("keys_free_after_return_s", round(freed_after, 3))
    assert freed_after <= lease
    # And a new send of each until_executed key is taken, not refused as a duplicate, and runs once
    again = [h.app.once.send(f"{name}-u{i}") for name in ("stopping", "staying") for i in range(2)]
    assert [m.options.get("unique_duplicate_of") for m in again] == [None] * len(again)
    for message in again:
        h.finished(message.message_id, timeout=30)
    # And nothing was lost or run twice
    assert sorted(r.message_id for r in h.runs()) == sorted(m.message_id for m in sent + again)
    assert overlaps(h.runs()) == []
