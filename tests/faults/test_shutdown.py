"""Case 8: a graceful SIGTERM releases the run locks of in-flight
messages and keeps the client locks of messages that go back to the
broker unprocessed.
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.conftest import wait_for
from tests.faults.harness import rabbitmq_ready


def waiting(h):
    """Messages back in the broker: (queue, delay queue)."""
    if h.env["FAULTS_BROKER"] == "rabbitmq":
        url = h.env["FAULTS_RABBITMQ_URL"]
        return rabbitmq_ready(url, h.namespace), rabbitmq_ready(url, f"{h.namespace}.DQ")
    q = f"{h.namespace}:{h.namespace}"
    return int(h.records.llen(q)), int(h.records.llen(f"{q}.DQ"))


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_a_graceful_shutdown_releases_run_locks_and_keeps_client_locks(make_harness, figure, broker):
    # Given a one-minute lease, so only a release frees a run lock during this test,
    # and a single-thread worker busy with a while_executing job
    h = make_harness(broker, FAULTS_LEASE="60000")
    group = h.workers(processes=1, threads=1)
    running = h.app.hold.send("k", gate="running")
    h.started(running.message_id)
    # And two until_executed messages it has fetched but not started: one due, one delayed
    queued = h.app.once.send("q")
    delayed = h.app.once.send_with_options(args=("d",), delay=600_000)
    wait_for(lambda: waiting(h) == (0, 0), what="the worker to fetch both messages")
    # When the group gets SIGTERM while the job runs, and the job then finishes
    group.process.send_signal(signal.SIGTERM)
    wait_for(lambda: "Shutting down..." in group.output(), what="the worker to stop taking messages")
    h.open_gate("running")
    stopping = time.time()
    assert group.process.wait(timeout=30) == 0
    figure("shutdown_s", round(time.time() - stopping, 3))
    # Then the in-flight message completed and released its run lock: its lease had 60 s left
    assert [r.message_id for r in h.runs()] == [running.message_id]
    assert h.lock("hold", "k", "run") is None
    # And the fetched messages went back to the broker, each still holding its client lock
    wait_for(lambda: waiting(h) == (1, 1), what="both messages back in the broker")
    assert list(h.lock("once", "q", "queue").holders) == [queued.message_id]
    assert list(h.lock("once", "d", "queue").holders) == [delayed.message_id]
    assert h.app.once.send("q").options["unique_duplicate_of"] == queued.message_id
    # And the next group runs the queued one once, which then frees its key
    h.workers(processes=1, threads=1)
    h.finished(queued.message_id)
    wait_for(lambda: h.lock("once", "q", "queue") is None, what="the queued message's lock to be released")
    assert [r.message_id for r in h.runs()].count(queued.message_id) == 1
    assert list(h.lock("once", "d", "queue").holders) == [delayed.message_id]
