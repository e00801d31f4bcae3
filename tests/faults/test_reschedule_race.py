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

    def join_line(self, copy, message, *, order, ttl):  # type: ignore[no-untyped-def]
        time.sleep(STALL_S)
        super().join_line(copy, message, order=order, ttl=ttl)


def run_holder_and_waiter(broker, holder_seconds, **options):  # type: ignore[no-untyped-def]
    """Send a holder of key k and a message that must wait for it; run
    both to the end and count each message's runs.
    """
    runs: Counter[str] = Counter()
    mutex = threading.Lock()

    @dramatiq.actor(broker=broker, lock="while_executing", lock_args=["key"], **options)
    def sync(key, name, seconds):
        with mutex:
            runs[name] += 1
        time.sleep(seconds)

    sync.send("k", "holder", holder_seconds)
    sync.send("k", "waiter", 0.0)
    worker = make_worker(broker, threads=4)
    try:
        broker.join(sync.queue_name, fail_fast=False)
        worker.join()
    finally:
        worker.stop()
    return runs


def test_a_stalled_reschedule_still_runs_the_message_once(stub_broker):
    # Given a backend where every reschedule stalls past the reschedule delay
    stub_broker.add_middleware(unique(StallingBackend(), reschedule_delay=50))
    # When a holder of key k runs for a second while a second message waits
    runs = run_holder_and_waiter(stub_broker, 1.0, max_retries=0)
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
    # When the waiter's copy cannot be enqueued while the holder runs (it is
    # retried after the holder is done, so the retry cannot stand in for a
    # waiter the release would hand the key to)
    runs = run_holder_and_waiter(stub_broker, 0.3, max_retries=5, min_backoff=1000, max_backoff=1000)
    # Then the failure went through Retries, and the holder's release did not
    # hand the key to the withdrawn waiter as well: each ran once
    assert outage.refused == 1
    assert runs == {"holder": 1, "waiter": 1}
