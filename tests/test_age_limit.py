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


def test_the_age_limit_is_looked_up_again_when_the_stack_changes(stub_broker):
    # Given an old message of an actor with a max_age, and a guard that has already looked at the stack
    middleware = unique(StubBackend())
    stub_broker.add_middleware(middleware)

    @dramatiq.actor(broker=stub_broker, lock="while_executing", max_age=1_000)
    def sync() -> None:
        pass

    old = sync.message().copy(message_timestamp=1)
    guard = middleware._process
    assert guard._expired(stub_broker, old)
    # When AgeLimit leaves the stack, and then comes back
    age_limits = [m for m in stub_broker.middleware if isinstance(m, AgeLimit)]
    for age_limit in age_limits:
        stub_broker.middleware.remove(age_limit)
    gone = guard._expired(stub_broker, old)
    stub_broker.middleware.append(AgeLimit())
    # Then each change is seen: no limit to expire by, then one again
    assert not gone
    assert guard._expired(stub_broker, old)
    assert not guard._expired(stub_broker, sync.message())
