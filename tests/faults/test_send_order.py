"""Hand-offs in send order: the waiters of one key run in the order
they were sent, sends of the same millisecond included, whatever the
reschedule delay (their delayed copies come back, again and again,
while they wait), with no fault and after the holder's worker process
is killed or stopped, on the Redis broker and on RabbitMQ.
"""

from __future__ import annotations

import signal
import time
from collections import Counter

import pytest

from tests.conftest import wait_for
from tests.faults.harness import Harness

SENDS = 20
EVENTS = "rescheduled,skipped,lock_lost,backend_error"
#: A worker group that prefetches only the message it runs: the holder
#: group takes no waiter, so that killing it loses none for long.
ONE_AT_A_TIME = {"dramatiq_queue_prefetch": "1", "dramatiq_delay_queue_prefetch": "1"}


def inversions(order: list[int]) -> int:
    """Pairs of waiters that ran in the opposite order to their sends."""
    return sum(1 for i in range(len(order)) for j in range(i + 1, len(order)) if order[i] > order[j])


def send_waiters(h: Harness) -> list:  # type: ignore[type-arg]
    """SENDS messages of key k, sent in one loop (several within one
    millisecond), once every one of them waits for k.
    """
    sent = [h.app.hold.message("k", seconds=0.01) for _ in range(SENDS)]
    for message in sent:
        h.app.broker.enqueue(message)
    unique, spec = h.app.unique, h.app.unique.specs["hold"]
    key = unique.key(spec, spec.digest(("k",), {}), "run")
    wait_for(lambda: len(unique.backend.waiters(key)) == SENDS, timeout=30, what="every send to wait for k")
    return sent


def first_starts(h: Harness, sent: list) -> list[int]:  # type: ignore[type-arg]
    """The place of each waiter among the waiters' first starts."""
    wait_for(lambda: {r.message_id for r in h.runs()} >= {m.message_id for m in sent}, timeout=90,
             what="every waiter to run")
    ran: list[str] = []
    for run in sorted(h.starts(), key=lambda run: run.start):
        if run.message_id not in ran:
            ran.append(run.message_id)
    waiters = [m for m in ran if m in {message.message_id for message in sent}]
    return [waiters.index(message.message_id) for message in sent]


@pytest.mark.parametrize(
    "broker,delay",
    # The default run takes the shortest delay and the default 5 s on each
    # broker; the delays between and beyond them run with --soak.
    [("redis", 300), pytest.param("redis", 1000, marks=pytest.mark.soak), ("redis", 5000),
     pytest.param("redis", 10000, marks=pytest.mark.soak), ("rabbitmq", 300), ("rabbitmq", 5000)],
)
def test_waiters_of_one_key_are_handed_it_in_send_order(make_harness, figure, broker, delay):
    # Given a job holding key k for 4 s, and reschedules that bring delayed copies back every `delay` ms
    h = make_harness(broker, FAULTS_RESCHEDULE_DELAY=str(delay), FAULTS_EVENTS=EVENTS)
    h.workers(processes=1, threads=4)
    holder = h.app.hold.send("k", gate="holder")
    h.started(holder.message_id)
    began = time.monotonic()
    # When 20 messages of k are sent in one loop, several of them within one millisecond
    sent = send_waiters(h)
    per_ms = Counter(int(message.message_timestamp) for message in sent)
    time.sleep(max(0.0, 4 - (time.monotonic() - began)))
    h.open_gate("holder")
    # Then each waiter is handed the key in the order it was sent, and runs once
    order = first_starts(h, sent)
    runs = Counter(run.message_id for run in h.runs())
    figure("sends_sharing_a_millisecond", max(per_ms.values()))
    figure("inversions", inversions(order))
    figure("most_reschedules", max(Counter(e["message_id"] for e in h.events("rescheduled")).values()))
    assert max(per_ms.values()) >= 2, per_ms
    assert h.starts()[0].message_id == holder.message_id
    assert order == list(range(SENDS)), order
    assert all(runs[m.message_id] == 1 for m in sent), runs


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_waiters_keep_send_order_when_the_holders_worker_stops(make_harness, figure, broker, how):
    # Given a job holding key k in a worker group of its own (a 2 s lease), and waiters served by another,
    # their delayed copies coming back every 300 ms
    h = make_harness(broker, FAULTS_RESCHEDULE_DELAY="300", FAULTS_EVENTS=EVENTS, FAULTS_HEARTBEAT_TIMEOUT="3000")
    holding = h.workers(processes=1, threads=1, **ONE_AT_A_TIME)
    holder = h.app.hold.send("k", gate="holder")
    h.started(holder.message_id)
    h.workers(processes=1, threads=4)
    sent = send_waiters(h)
    time.sleep(1)  # the delayed copies come back a few times
    # When the holder's worker is killed mid-run, or stopped (SIGTERM) and its job then ends
    if how == "SIGKILL":
        holding.kill()
        h.open_gate("holder")  # its redelivery, which runs again after the lease ran out, does not wait
    else:
        assert holding.process is not None
        holding.process.send_signal(signal.SIGTERM)
        wait_for(lambda: "Shutting down..." in holding.output(), what="the holder's worker to stop taking messages")
        h.open_gate("holder")
        assert holding.process.wait(timeout=60) == 0
    # Then the waiters still run in the order they were sent, each once
    order = first_starts(h, sent)
    runs = Counter(run.message_id for run in h.runs())
    figure("inversions", inversions(order))
    assert order == list(range(SENDS)), order
    assert all(runs[m.message_id] == 1 for m in sent), runs
