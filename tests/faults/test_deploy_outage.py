"""Case 9: a deploy during a lock-Redis outage.

A worker group is SIGTERMed while the network to its lock Redis is
down, after an ``until_executed`` job succeeded whose release could not
be sent.  The stopping process knows what it owes: it writes the owed
releases to the broker, where the next worker finds them and makes
them once the lock Redis is reachable.  A SIGKILLed process knows
nothing, and its ``until_executed`` lock is kept until its redelivery
runs (``test_crash.py``).

The lock Redis is a server of its own behind a proxy; the broker (the
Redis broker on the record Redis, or RabbitMQ) stays reachable.

Figures: ``shutdown_s``, from the SIGTERM to the exit of the group;
``accepted_after_heal_s`` and ``accepted_after_ready_s``, from the
network's return and from the new group's boot to the first new send
of the key that is accepted.
"""

from __future__ import annotations

import signal
import time
from datetime import datetime
from typing import Iterator

import pytest

from tests.conftest import wait_for
from tests.faults.harness import Harness, RedisServer
from tests.faults.proxy import Proxy, through

LEASE_S = 2.0
#: The bound of a shutdown, in seconds: the default of
#: ``dramatiq_unique_shutdown_timeout``.
SHUTDOWN_BOUND_S = 10.0
#: What a process needs besides our waits to exit: Dramatiq's own
#: stop (consumers polling every 100 ms), the interpreter's exit, and
#: scheduling noise on a loaded machine.
EXIT_SLACK_S = 3.0


@pytest.fixture
def lock_proxy(lock_server: RedisServer) -> Iterator[Proxy]:
    """A proxy in front of a lock Redis of its own."""
    with Proxy(lock_server.port) as proxy:
        yield proxy


def accepted(h: Harness) -> bool:
    """Whether a new send of ``once("k")`` is accepted (and enqueued)."""
    try:
        return "unique_duplicate_of" not in h.app.once.send("k").options
    except Exception:  # the lock Redis is still out of reach: not accepted
        return False


def released_failed(h: Harness) -> bool:
    return any(event["key"].endswith(":queue") for event in h.events("backend_error"))


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_a_release_owed_at_a_deploy_during_an_outage_is_made_by_the_next_worker(
    make_harness, lock_server, lock_proxy, figure, broker
):
    # Given workers whose lock Redis is reached through a proxy, and an until_executed job running
    # (a shutdown bound of 3 s: the default's 10 s is the next test's)
    h = make_harness(broker, FAULTS_LOCK_URL=through(lock_proxy, lock_server.url),
                     FAULTS_LEASE=str(int(LEASE_S * 1000)), FAULTS_SOCKET_TIMEOUT="1",
                     dramatiq_unique_shutdown_timeout="3000")
    group = h.workers(processes=1, threads=2)
    job = h.app.once.send("k", gate="ran")
    h.started(job.message_id)
    # When the network to the lock Redis goes silent, the job succeeds and its release cannot be sent
    lock_proxy.blackhole()
    h.open_gate("ran")
    h.finished(job.message_id)
    wait_for(lambda: released_failed(h), timeout=30, what="the release to fail")
    # And the group is SIGTERMed during the outage (a deploy)
    group.process.send_signal(signal.SIGTERM)
    stopping = time.monotonic()
    assert group.process.wait(timeout=60) == 0
    figure("shutdown_s", round(time.monotonic() - stopping, 2))
    assert accepted(h) is False  # still out of reach
    # And the network comes back, and a new group starts
    lock_proxy.heal()
    healed = time.monotonic()
    h.workers(processes=1, threads=2)
    ready = time.monotonic()
    # Then a new send of the key is accepted within one lease of the new group's boot
    wait_for(lambda: accepted(h), timeout=30, interval=0.1, what="a new send of the key to be accepted")
    now = time.monotonic()
    figure("accepted_after_heal_s", round(now - healed, 2))
    figure("accepted_after_ready_s", round(now - ready, 2))
    assert now - ready <= LEASE_S + 1.0
    # And the job ran once
    assert [r.message_id for r in h.runs()] == [job.message_id]


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_a_sigterm_during_a_lock_redis_outage_stops_the_worker_within_the_bound(
    make_harness, lock_server, lock_proxy, figure, broker
):
    # Given workers with the default 5 s socket timeout on their lock Redis, behind a proxy
    h = make_harness(broker, FAULTS_LOCK_URL=through(lock_proxy, lock_server.url), FAULTS_LEASE="60000")
    group = h.workers(processes=1, threads=4)
    job = h.app.once.send("k", gate="ran")
    busy = [h.app.hold.send(f"busy{i}", gate="held") for i in range(2)]
    h.started(job.message_id)
    for message in busy:
        h.started(message.message_id)
    # When the network to the lock Redis goes silent while jobs end and new ones start
    lock_proxy.blackhole()
    h.open_gate("ran")
    h.open_gate("held")
    for i in range(6):
        h.app.hold.send(f"late{i}")
    wait_for(lambda: released_failed(h), timeout=30, what="a release to fail")
    # And the group is SIGTERMed with lock calls in flight
    group.process.send_signal(signal.SIGTERM)
    stopping = time.monotonic()
    code = group.process.wait(timeout=60)
    took = time.monotonic() - stopping
    # Then the worker's own shutdown took at most the bound, and the group exited soon after
    worker_s = logged_at(group.output(), "Worker has been shut down.") - logged_at(group.output(), "Shutting down...")
    figure("worker_shutdown_s", round(worker_s, 2))
    figure("shutdown_s", round(took, 2))
    assert code == 0
    assert worker_s <= SHUTDOWN_BOUND_S
    assert took <= SHUTDOWN_BOUND_S + EXIT_SLACK_S
    # And what it owed was written to the broker
    assert "could not be sent before shutdown: they were written to queue" in group.output()


def logged_at(output: str, text: str) -> float:
    """When the worker process logged the line that contains ``text``,
    in seconds (from its log's timestamp).
    """
    line = next(line for line in output.splitlines() if text in line)
    stamp = datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f")
    return stamp.timestamp()


def test_a_duplicate_after_a_release_that_outlived_an_outage_is_skipped(make_harness, lock_server, lock_proxy, figure):
    # The case docs/reliability.md leaves narrowed, not closed: a run's
    # release cannot be sent until after its lease ran out.  Once it lands
    # it ends the run in the message's record, so a copy that comes after
    # that is skipped; one that came between the lapse and the landing
    # would run again (the window is the figure).
    from dramatiq_unique.backends.redis import RedisBackend

    # Given a message rescheduled behind a holder, whose delayed copy comes back 8 s later
    h = make_harness("redis", FAULTS_LOCK_URL=through(lock_proxy, lock_server.url),
                     FAULTS_LEASE=str(int(LEASE_S * 1000)), FAULTS_SOCKET_TIMEOUT="1", FAULTS_RESCHEDULE_DELAY="8000",
                     FAULTS_EVENTS="rescheduled,skipped,backend_error")
    h.workers(processes=1, threads=2)
    holder = h.app.hold.send("k", gate="a")
    h.started(holder.message_id)
    waiting = h.app.hold.send("k", gate="m")
    wait_for(lambda: any(e["message_id"] == waiting.message_id for e in h.events("rescheduled")), what="the reschedule")
    # When the key is handed to it, and the network to the lock Redis goes silent before its run ends
    h.open_gate("a")
    h.started(waiting.message_id)
    lock_proxy.blackhole()
    h.open_gate("m")
    h.finished(waiting.message_id)
    wait_for(lambda: any(e["key"].endswith(":run") for e in h.events("backend_error")), timeout=30,
             what="the run's release to fail")
    # And its lease runs out while the network is down (read past the proxy)
    locks = RedisBackend(url=lock_server.url)
    [run_key] = [key.decode() for key in locks.client.scan_iter("*:run")]

    def lapsed() -> bool:
        info = locks.inspect(run_key)
        return info is None or not info.holders

    wait_for(lapsed, timeout=30, interval=0.1, what="the lease to run out")
    lapsed_at = time.monotonic()
    time.sleep(2)  # the outage goes on past the lease: its length
    # (a copy arriving now would run again: the record does not know the run ended)
    assert locks.client.hget(record_of(locks, waiting.message_id), "finished") is None
    lock_proxy.heal()
    healed = time.monotonic()
    figure("outage_past_the_lease_s", round(healed - lapsed_at, 2))
    # Then the release lands soon after the network is back, and ends the run in the record
    record = record_of(locks, waiting.message_id)
    wait_for(lambda: locks.client.hget(record, "finished") is not None, timeout=30, interval=0.05,
             what="the release to land")
    figure("release_landed_after_heal_s", round(time.monotonic() - healed, 2))
    # And the delayed copy, which comes after that, is skipped: the message ran once
    wait_for(lambda: any(e["message_id"] == waiting.message_id for e in h.events("skipped")), timeout=30,
             what="the delayed copy to be skipped")
    assert [r.message_id for r in h.starts()].count(waiting.message_id) == 1
    locks.close()


def record_of(locks, message_id: str) -> bytes:  # type: ignore[no-untyped-def]
    """The key of a message's record in the lock Redis."""
    [record] = list(locks.client.scan_iter(f"*:m:{message_id}"))
    return record
