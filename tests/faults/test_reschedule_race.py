"""A rescheduled message whose worker thread stalls between re-enqueueing
it and registering it as a waiter must still run once.

Found by the load test: one message in 10,120 ran twice when a busy
worker registered the waiter after the delayed copy had already
arrived and claimed its ticket, so the later hand-off ran it again.
Here the stall is injected: registering a waiter takes longer than the
reschedule delay.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import dramatiq
from dramatiq.middleware import MiddlewareError

from dramatiq_unique import StubBackend
from tests.conftest import make_worker, unique

#: Longer than the reschedule delay: the delayed copy is due before the
#: waiter is registered, as on a worker starved of CPU.
STALL_S = 0.3


class StallingBackend(StubBackend):
    """A stub backend whose ``wait`` stalls its caller."""

    def wait(self, key, ticket, message, *, order, ttl):  # type: ignore[no-untyped-def]
        time.sleep(STALL_S)
        super().wait(key, ticket, message, order=order, ttl=ttl)


def test_a_stalled_reschedule_still_runs_the_message_once(stub_broker):
    stub_broker.add_middleware(unique(StallingBackend(), reschedule_delay=50))
    runs: Counter[str] = Counter()
    mutex = threading.Lock()

    @dramatiq.actor(broker=stub_broker, lock="while_executing", lock_args=["key"], max_retries=0)
    def sync(key, name, seconds):
        with mutex:
            runs[name] += 1
        time.sleep(seconds)

    # Given a holder of key k for a second, and a second message for k that must wait
    sync.send("k", "holder", 1.0)
    sync.send("k", "waiter", 0.0)
    # When every reschedule stalls past the reschedule delay
    worker = make_worker(stub_broker, threads=4)
    try:
        stub_broker.join(sync.queue_name, fail_fast=False)
        worker.join()
    finally:
        worker.stop()
    # Then each message ran exactly once
    assert runs == {"holder": 1, "waiter": 1}


class RefuseFirstReschedule(dramatiq.Middleware):
    """A broker that fails to publish the first rescheduled copy."""

    def __init__(self) -> None:
        self.refused = 0

    def before_enqueue(self, broker, message, delay):  # type: ignore[no-untyped-def]
        if message.options.get("unique_reschedules") and not self.refused:
            self.refused += 1
            raise MiddlewareError("publish failed")


def test_a_reschedule_that_cannot_be_enqueued_withdraws_its_waiter(stub_broker):
    # Given a broker that fails to publish the first rescheduled copy
    stub_broker.add_middleware(unique(StubBackend(), reschedule_delay=50))
    outage = RefuseFirstReschedule()
    stub_broker.add_middleware(outage)
    runs: Counter[str] = Counter()
    mutex = threading.Lock()

    # (retried after the holder is done, so the retry cannot stand in for a
    # waiter the release would hand the key to)
    @dramatiq.actor(broker=stub_broker, lock="while_executing", lock_args=["key"], max_retries=5,
                    min_backoff=1000, max_backoff=1000)
    def sync(key, name, seconds):
        with mutex:
            runs[name] += 1
        time.sleep(seconds)

    # When the waiter's copy cannot be enqueued while the holder runs
    sync.send("k", "holder", 0.3)
    sync.send("k", "waiter", 0.0)
    worker = make_worker(stub_broker, threads=4)
    try:
        stub_broker.join(sync.queue_name, fail_fast=False)
        worker.join()
    finally:
        worker.stop()
    # Then the failure went through Retries, and the holder's release did not
    # hand the key to the withdrawn waiter as well: each ran once
    assert outage.refused == 1
    assert runs == {"holder": 1, "waiter": 1}
