"""The reschedule hand-off with real workers: each of the situations
that broke before the hand-off had a model (see ``docs/reliability.md``,
"The hand-off model"), on the Redis broker and on RabbitMQ.

A rescheduled message exists as two copies: the delayed copy, and the
copy the holder's release hands the key to.  Here the hand-off always
wins, and the delayed copy arrives after the real run, as it does
whenever the holder finishes within the reschedule delay.
"""

from __future__ import annotations

import time

import pytest
from dramatiq import group

from tests.conftest import wait_for
from tests.faults.harness import Harness, rabbitmq_messages, stopped

BROKERS = ["redis", "rabbitmq"]
EVENTS = "rescheduled,skipped,lock_lost,backend_error"


def in_flight(h: Harness) -> int:
    """Messages queued, delayed, prefetched or running, anywhere."""
    if h.env["FAULTS_BROKER"] == "redis":
        return h.queued()
    return rabbitmq_messages(h.env["FAULTS_RABBITMQ_URL"], h.namespace)


def copies(h: Harness, event: str, message_id: str) -> int:
    return sum(1 for e in h.events(event) if e["message_id"] == message_id)


def rescheduled_behind(h: Harness, actor, key: str, **options) -> tuple:  # type: ignore[no-untyped-def]
    """A holder of ``key`` gated on "a", and a second message of the
    key rescheduled behind it: both sent, the second one waiting.
    """
    holder = actor.send(key, gate="a", **options)
    h.started(holder.message_id)
    waiting = actor.send(key, **options)
    wait_for(lambda: copies(h, "rescheduled", waiting.message_id) >= 1, what="the reschedule")
    return holder, waiting


def starts_of(h: Harness, message_id: str) -> int:
    return [r.message_id for r in h.starts()].count(message_id)


@pytest.mark.parametrize("broker", BROKERS)
def test_the_enqueue_lock_is_free_after_a_handed_over_run(make_harness, broker, figure):
    # Given "enqueue once, run serialized", and a send rescheduled behind a running one
    h = make_harness(broker, FAULTS_RESCHEDULE_DELAY="1000", FAULTS_EVENTS=EVENTS)
    h.workers(processes=1, threads=2)
    _, waiting = rescheduled_behind(h, h.app.serial, "k")
    # When the holder ends, the key is handed over, and the delayed copy arrives afterwards
    h.open_gate("a")
    h.finished(waiting.message_id)
    wait_for(lambda: copies(h, "skipped", waiting.message_id) == 1, what="the delayed copy to be skipped")
    wait_for(lambda: in_flight(h) == 0, what="every copy to be gone")
    # Then no enqueue lock is left behind, and a new send of the key is accepted and runs
    assert h.lock("serial", "k", "queue") is None
    fresh = h.app.serial.send("k")
    assert "unique_duplicate_of" not in fresh.options
    h.finished(fresh.message_id)
    assert starts_of(h, waiting.message_id) == 1


@pytest.mark.parametrize("broker", BROKERS)
def test_a_rescheduled_message_keeps_the_result_of_its_real_run(make_harness, broker):
    # Given a send rescheduled behind a running one, and a group of the same key
    h = make_harness(broker, FAULTS_RESCHEDULE_DELAY="1000", FAULTS_EVENTS=EVENTS)
    h.workers(processes=1, threads=2)
    _, waiting = rescheduled_behind(h, h.app.hold, "k")
    members = group([h.app.hold.message("g", gate="g")] + [h.app.hold.message("g") for _ in range(3)],
                    broker=h.app.broker).run()
    # When both keys are released
    h.open_gate("a")
    h.open_gate("g")
    # Then the caller gets the real run's result, and still has it after the skipped copy came and went
    first = waiting.get_result(backend=h.app.results, block=True, timeout=30_000)
    assert first["message_id"] == waiting.message_id
    results = list(members.get_results(block=True, timeout=30_000))
    assert [r["message_id"] for r in results] == [m.message_id for m in members.children]
    wait_for(lambda: copies(h, "skipped", waiting.message_id) == 1, what="the delayed copy to be skipped")
    wait_for(lambda: in_flight(h) == 0, what="every copy to be gone")
    assert waiting.get_result(backend=h.app.results) == first
    assert [m.get_result(backend=h.app.results) for m in members.children] == results


@pytest.mark.parametrize("broker", BROKERS)
def test_a_handed_over_message_starts_at_most_one_plus_max_retries_times(make_harness, broker):
    # Given an actor with max_retries=1, and a message that always fails, rescheduled behind a running one
    h = make_harness(broker, FAULTS_RESCHEDULE_DELAY="1000", FAULTS_EVENTS=EVENTS)
    h.workers(processes=1, threads=2)
    holder = h.app.flaky.send("k", fails=0, gate="a")
    h.started(holder.message_id)
    failing = h.app.flaky.send("k", fails=99)
    wait_for(lambda: copies(h, "rescheduled", failing.message_id) >= 1, what="the reschedule")
    # When the key is handed to it, it fails, is retried once, and its stale delayed copy arrives
    h.open_gate("a")
    wait_for(lambda: copies(h, "skipped", failing.message_id) == 1, what="the delayed copy to be skipped")
    wait_for(lambda: in_flight(h) == 0, what="every copy to be gone")
    # Then it started exactly twice: its run and its one retry
    assert starts_of(h, failing.message_id) == 2


@pytest.mark.parametrize("broker", BROKERS)
def test_a_stalled_lock_redis_does_not_run_a_finished_message_again(make_harness, lock_server, broker, figure):
    # Given locks in a Redis of their own, and calls that time out after 1 s
    h = make_harness(broker, FAULTS_LOCK_URL=lock_server.url, FAULTS_SOCKET_TIMEOUT="1",
                     FAULTS_RESCHEDULE_DELAY="2000", FAULTS_EVENTS=EVENTS)
    h.workers(processes=1, threads=2)
    _, waiting = rescheduled_behind(h, h.app.hold, "k")
    h.open_gate("a")
    h.finished(waiting.message_id)
    # When the lock Redis stalls for 4 s while the delayed copy of the message that already ran arrives
    assert lock_server.process is not None
    with stopped(lock_server.process.pid):
        time.sleep(4)  # the length of the stall
    stalled_calls = len(h.events("backend_error"))
    # Then its timed-out calls are retried, the retries are skipped, and it ran exactly once
    wait_for(lambda: copies(h, "skipped", waiting.message_id) >= 1, what="the delayed copy to be skipped")
    wait_for(lambda: in_flight(h) == 0, what="every copy to be gone")
    figure("timed_out_calls", stalled_calls)
    assert stalled_calls >= 1
    assert starts_of(h, waiting.message_id) == 1


def test_a_lock_redis_that_forgets_its_records_loses_no_message(make_harness, lock_server, figure):
    # Given ten messages rescheduled behind a running one, their records in a lock Redis without persistence
    h = make_harness("redis", FAULTS_LOCK_URL=lock_server.url, FAULTS_RESCHEDULE_DELAY="500", FAULTS_EVENTS=EVENTS)
    h.workers(processes=1, threads=4)
    holder = h.app.hold.send("k", gate="a")
    h.started(holder.message_id)
    waiting = [h.app.hold.send("k") for _ in range(10)]
    wait_for(lambda: all(copies(h, "rescheduled", m.message_id) for m in waiting), what="every reschedule")
    # When that Redis restarts empty, and the holder ends
    lock_server.restart()
    h.open_gate("a")
    # Then every waiting message still runs: at least once, as documented
    for message in waiting:
        h.finished(message.message_id)
    wait_for(lambda: in_flight(h) == 0, what="every copy to be gone")
    twice = sum(1 for m in waiting if starts_of(h, m.message_id) > 1)
    figure("waiting_messages", len(waiting))
    figure("ran_twice_after_the_restart", twice)
    assert all(starts_of(h, m.message_id) >= 1 for m in waiting)
