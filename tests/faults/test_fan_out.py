"""Waiting costs little however many wait: many waiters of one key
behind a 3 s holder (5 ms jobs, 2 worker processes x 8 threads) run in
send order, each once and rescheduled at most 4 times, and the lock
Redis processes few commands per waiter: a delayed copy that comes back
while its message is still in line changes nothing and comes back
later.  The default run has 200 waiters with a 1 s reschedule delay, so
that their delayed copies come back while they drain (before: out of
order, up to 19 reschedules).  The 1,000-waiter run of issue 29, at the
default 5 s delay, is the soak variant (``--soak``): it also holds the
drain to 2.5 x the work and the commands to half of the 128.8 a waiter
cost before.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter

import pytest
import redis

from tests.conftest import wait_for
from tests.faults.harness import Harness, RedisServer

JOB_S = 0.005
HOLD_S = 3


def commands(client: redis.Redis) -> tuple[int, int]:
    """Commands the server processed since its stats were reset: the
    clients' own (scripts count once), and every command, the scripts'
    calls included.
    """
    stats = client.info("stats")
    every = sum(int(entry["calls"]) for entry in client.info("commandstats").values())
    return int(stats["total_commands_processed"]), every


def inversions(order: list[int]) -> int:
    """Pairs that ran in the opposite order to their sends (O(n log n))."""
    count, seen = 0, []  # type: ignore[var-annotated]
    for place in reversed(order):
        count += bisect.bisect_left(seen, place)
        bisect.insort(seen, place)
    return count


def fan_out(h: Harness, lock_server: RedisServer, waiters: int, figure) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """Send ``waiters`` messages of key k behind a 3 s holder; check that
    each ran once, in send order, rescheduled at most 4 times; return
    how long they took to drain after the holder, in units of their
    work, and the lock Redis's commands per waiter.
    """
    client = redis.Redis.from_url(lock_server.url)
    h.workers(processes=2, threads=8)
    holder = h.app.hold.send("k", seconds=HOLD_S)
    h.started(holder.message_id)
    client.config_resetstat()
    began = time.monotonic()
    sent = [h.app.hold.message("k", seconds=JOB_S) for _ in range(waiters)]
    for message in sent:
        h.app.broker.enqueue(message)
    figure("sent_in_s", round(time.monotonic() - began, 2))
    ids = {message.message_id for message in sent}
    wait_for(lambda: len({r.message_id for r in h.runs()} & ids) == waiters, timeout=60 + waiters * 0.1,
             what="every waiter to run")
    wait_for(lambda: h.queued() == 0, timeout=60, what="every delayed copy to come and go")
    own, every = commands(client)
    runs = h.runs()
    holder_end = next(r.end for r in runs if r.message_id == holder.message_id)
    last_end = max(r.end or 0 for r in runs if r.message_id in ids)
    drained = last_end - holder_end
    work = waiters * JOB_S
    per_message = Counter(r.message_id for r in runs if r.message_id in ids)
    reschedules = Counter(e["message_id"] for e in h.events("rescheduled") if e["message_id"] in ids)
    first = sorted((r for r in h.starts() if r.message_id in ids), key=lambda r: r.start)
    ran = list(dict.fromkeys(r.message_id for r in first))
    order = [ran.index(m.message_id) for m in sent]
    figure("waiters", waiters)
    figure("drained_after_the_holder_s", round(drained, 2))
    figure("drained_in_work", round(drained / work, 2))
    figure("most_reschedules", max(reschedules.values()))
    figure("reschedules_per_waiter", round(sum(reschedules.values()) / waiters, 2))
    figure("inversions", inversions(order))
    figure("lock_redis_calls_per_waiter", round(own / waiters, 1))
    figure("lock_redis_commands_per_waiter", round(every / waiters, 1))
    assert set(per_message.values()) == {1}, per_message
    assert order == list(range(waiters))
    assert max(reschedules.values()) <= 4, reschedules.most_common(3)
    return drained / work, every / waiters


def test_many_waiters_of_one_key_drain_in_order_at_little_cost(make_harness, lock_server, figure):
    # 200 waiters with a 1 s reschedule delay: their delayed copies come back while they drain
    h = make_harness("redis", FAULTS_LOCK_URL=lock_server.url, FAULTS_RESCHEDULE_DELAY="1000",
                     FAULTS_LEASE="10000", FAULTS_EVENTS="rescheduled")
    fan_out(h, lock_server, 200, figure)


@pytest.mark.soak
def test_a_thousand_waiters_of_one_key_drain_in_order_at_little_cost(make_harness, lock_server, figure):
    h = make_harness("redis", FAULTS_LOCK_URL=lock_server.url, FAULTS_RESCHEDULE_DELAY="5000",
                     FAULTS_LEASE="10000", FAULTS_EVENTS="rescheduled")
    drained, per_waiter = fan_out(h, lock_server, 1000, figure)
    # the targets of issue 29: within 2.5 x the work, and half the 128.8 commands a waiter cost before
    assert per_waiter <= 64, per_waiter
    assert drained <= 2.5, drained
