"""AgeLimit around a reschedule: a message that expires while it waits
is dead-lettered once, and leaves no waiter behind.
"""

from __future__ import annotations

import threading

import dramatiq
from dramatiq.middleware import AgeLimit

from dramatiq_unique import StubBackend
from tests.conftest import make_worker, unique, wait_for


def test_a_waiting_message_that_expires_is_dead_lettered_once(stub_broker):
    # Given a message rescheduled behind a running one, with a max_age shorter than the wait
    locks = StubBackend()
    stub_broker.add_middleware(unique(locks, reschedule_delay=100))
    release = threading.Event()

    @dramatiq.actor(broker=stub_broker, lock="while_executing", lock_args=["account_id"], max_age=500)
    def sync(account_id: int, hold: bool = False) -> None:
        if hold:
            release.wait(10)

    worker = make_worker(stub_broker, threads=2)
    try:
        sync.send(1, hold=True)
        late = sync.send(1)
        wait_for(lambda: any(w.order for w in locks._waiters.values()), what="the waiter")
        # When it outlives its max_age while it waits, and then the key is handed over
        wait_for(lambda: len(stub_broker.dead_letters) == 1, what="AgeLimit to dead-letter it")
        release.set()
        stub_broker.join(sync.queue_name, fail_fast=False)
        worker.join()
        # Then it was dead-lettered once, and no waiter of it is left to hand the key to
        assert [m.message_id for m in stub_broker.dead_letters] == [late.message_id]
        assert not any(w.order for w in locks._waiters.values())
    finally:
        release.set()
        worker.stop()


def test_a_change_of_the_stack_is_seen_by_the_next_job(stub_broker):
    # Given a worker whose stack has no AgeLimit, and an actor with a max_age
    middleware = unique(StubBackend())
    stub_broker.add_middleware(middleware)
    ran: list[int] = []

    @dramatiq.actor(broker=stub_broker, lock="while_executing", max_age=1_000)
    def sync(n: int) -> None:
        ran.append(n)

    for age_limit in [m for m in stub_broker.middleware if isinstance(m, AgeLimit)]:
        stub_broker.middleware.remove(age_limit)
    worker = make_worker(stub_broker, threads=1)
    try:
        # When a message older than its max_age runs, AgeLimit is added, and another such message arrives
        stub_broker.enqueue(sync.message(1).copy(message_timestamp=1))
        stub_broker.join(sync.queue_name, fail_fast=False)
        worker.join()
        stub_broker.middleware.append(AgeLimit())
        late = stub_broker.enqueue(sync.message(2).copy(message_timestamp=1))
        stub_broker.join(sync.queue_name, fail_fast=False)
        worker.join()
        # Then the first ran, with no limit to expire by; the second took no lock and was dead-lettered
        assert ran == [1]
        assert middleware.events.count("locked") == 1
        assert [m.message_id for m in stub_broker.dead_letters] == [late.message_id]
    finally:
        worker.stop()
