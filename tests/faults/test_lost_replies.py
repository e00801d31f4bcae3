"""Calls that fail after their send: the server applied them, and the
caller saw a reset.  Every call may have happened.

The Redis broker and the locks share one Redis, reached through
:class:`tests.faults.proxy.Proxy`, which lets chosen requests reach the
server and drops their replies.  Figures: runs per message, overlaps,
and how long until every message had run.
"""

from __future__ import annotations

import time
from collections import Counter

from tests.conftest import wait_for
from tests.faults.harness import overlaps
from tests.faults.proxy import through

WAITERS = 3

#: How often Dramatiq's RabbitMQ broker publishes a message whose publish
#: failed (MAX_ENQUEUE_ATTEMPTS) before it raises.
PUBLISHES = 6


def test_a_reschedule_whose_enqueue_reply_is_lost_runs_each_message_once(make_harness, proxy, redis_url, figure):
    # Given a Redis broker and its locks behind the proxy, and a job holding key k
    url = through(proxy, redis_url)
    h = make_harness("redis", FAULTS_BROKER_URL=url, FAULTS_LOCK_URL=url)
    h.workers(processes=1, threads=WAITERS + 1)
    holder = h.app.hold.send("k", gate="holder")
    h.started(holder.message_id)
    # When each waiter's reschedule enqueues its delayed copy, and the reply to that enqueue is lost
    proxy.lose_replies(b'"unique_via":"delay"', f"{h.namespace}.DQ".encode(), times=WAITERS)
    began = time.monotonic()
    waiters = [h.app.hold.send("k") for _ in range(WAITERS)]
    wait_for(lambda: proxy.replies_lost >= WAITERS, timeout=30, what="the replies of the delayed enqueues to be lost")
    h.open_gate("holder")
    # Then every message runs, once: the delayed copy that was enqueued, and the retry of the copy
    # that saw the reset, are copies of one attempt, and only the first of them to arrive runs
    wait_for(lambda: len(h.runs()) >= WAITERS + 1 and h.queued() == 0, timeout=60, what="every message to run")
    drained = time.monotonic() - began
    # (a second run would come from a copy still in the delay queue: none is left, see queued())
    runs = h.runs()
    per_message = Counter(run.message_id for run in runs)
    figure("runs_per_message", sorted(per_message.values()))
    figure("overlaps", len(overlaps(runs)))
    figure("all_ran_after_s", round(drained, 2))
    assert proxy.replies_lost == WAITERS
    assert per_message == Counter({m.message_id: 1 for m in [holder, *waiters]}), per_message
    assert not overlaps(runs)


def test_a_release_that_met_a_network_drop_frees_its_key_once_the_network_is_back(
    make_harness, proxy, redis_url, figure
):
    # Given an until_executed job whose worker reaches the lock Redis through the proxy
    h = make_harness("redis", FAULTS_LOCK_URL=through(proxy, redis_url))
    h.workers(processes=1, threads=2)
    first = h.app.once.send("k", gate="run")
    h.started(first.message_id)
    # When the network drops just as the job succeeds, so that its release and every resend fail
    proxy.cut()
    h.open_gate("run")
    wait_for(lambda: h.events("backend_error"), timeout=30, what="the release to fail")
    time.sleep(0.2)  # the drop lasts a while: the first retries fail too
    proxy.heal()
    healed = time.monotonic()
    # Then, once the network is back, the key is freed and a new send of it is accepted within seconds
    accepted = None
    while time.monotonic() - healed < 10:
        again = h.app.once.send("k")
        if "unique_duplicate_of" not in again.options:
            accepted = time.monotonic() - healed
            break
        time.sleep(0.05)
    figure("accepted_again_after_s", None if accepted is None else round(accepted, 2))
    assert accepted is not None, "the key was still held 10 s after the network came back"
    assert h.finished(again.message_id).key == "k"


def test_a_reschedule_whose_publish_confirm_is_lost_runs_each_message_once_on_rabbitmq(
    make_harness, rabbitmq_proxy, rabbitmq_url, figure
):
    # Given workers that reach RabbitMQ, with publisher confirms, through the proxy, and a job holding key k
    proxy = rabbitmq_proxy
    h = make_harness("rabbitmq", FAULTS_CONFIRM_DELIVERY="1", FAULTS_EVENTS="rescheduled,skipped,backend_error")
    h.workers(processes=1, threads=WAITERS + 1, FAULTS_RABBITMQ_URL=through(proxy, rabbitmq_url))
    holder = h.app.hold.send("k", gate="holder")
    h.started(holder.message_id)
    # When every publish of each waiter's delayed copy reaches the broker and its confirm is lost with
    # its connection: Dramatiq publishes it again on a new connection (2.x six times, then raises)
    proxy.lose_replies(b'"unique_via":"delay"', f"{h.namespace}.DQ".encode(), times=PUBLISHES * WAITERS)
    began = time.monotonic()
    waiters = [h.app.hold.send("k") for _ in range(WAITERS)]
    wait_for(lambda: proxy.replies_lost >= PUBLISHES * WAITERS, timeout=60,
             what="the confirms of the delayed publishes to be lost")
    # and those copies come due while k is still held, so that they wait again
    wait_for(lambda: len(h.events("rescheduled")) >= 3 * WAITERS, timeout=30, what="the delayed copies to wait again")
    h.open_gate("holder")
    # Then every message runs, once: the six publishes of a delayed copy, and the retry of the
    # delivery that saw the error, are copies of one attempt, and only the first to arrive runs
    wait_for(lambda: len(h.runs()) >= WAITERS + 1 and h.queued() == 0, timeout=60, what="every message to run")
    drained = time.monotonic() - began
    runs = h.runs()
    per_message = Counter(run.message_id for run in runs)
    figure("copies_skipped", len(h.events("skipped")))
    figure("enqueues_that_raised", len(h.events("backend_error")))
    figure("runs_per_message", sorted(per_message.values()))
    figure("overlaps", len(overlaps(runs)))
    figure("all_ran_after_s", round(drained, 2))
    assert proxy.replies_lost == PUBLISHES * WAITERS
    assert per_message == Counter({m.message_id: 1 for m in [holder, *waiters]}), per_message
    assert not overlaps(runs)
