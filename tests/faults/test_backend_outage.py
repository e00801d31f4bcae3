"""Cases 3 and 4: the Redis that holds the locks goes away and comes
back, and a Redis that forgot its script cache.

The broker stays up on the suite's Redis; only the lock Redis, a
private ``redis-server``, is stopped (SIGKILL, no persistence).
"""

from __future__ import annotations

import time

import pytest
import redis

from dramatiq_unique import LockBackendError
from tests.conftest import wait_for
from tests.faults.harness import overlaps


def test_locks_fail_closed_while_their_redis_is_down(make_harness, lock_server, figure):
    # Given workers whose locks live in a Redis of their own, and a job holding a key
    h = make_harness("redis", FAULTS_LOCK_URL=lock_server.url)
    h.workers(processes=1, threads=2)
    holder = h.app.hold.send("k", gate="holder")
    h.started(holder.message_id)
    in_flight = h.queued()
    # When that Redis goes away mid-run
    lock_server.stop()
    down_at = time.time()
    # Then send() with a client lock raises an error naming the lock backend, and enqueues nothing
    with pytest.raises(LockBackendError) as refused:
        h.app.once.send("c")
    assert f"Lock backend RedisBackend({lock_server.url}) failed to take the enqueue lock" in str(refused.value)
    assert refused.value.backend == f"RedisBackend({lock_server.url})"
    assert h.queued() == in_flight
    # And a message whose run lock cannot be taken is not run but retried by Dramatiq
    waiting = h.app.hold.send("other")
    wait_for(lambda: attempts(h, waiting.message_id) >= 3, what="three failed attempts to take the lock")
    h.open_gate("holder")
    h.finished(holder.message_id)
    assert waiting.message_id not in [r.message_id for r in h.starts()]
    # And once Redis is back, it runs, once
    lock_server.start()
    up_at = time.time()
    run = h.finished(waiting.message_id)
    wait_for(lambda: h.queued() == 0, what="nothing left in flight")
    started_while_down = [r for r in h.starts() if down_at <= r.start < up_at]
    figure("runs_started_while_down", len(started_while_down))
    figure("attempts_while_down", attempts(h, waiting.message_id))
    figure("resumed_after_s", round(run.start - up_at, 3))
    assert started_while_down == []
    assert run.start >= up_at and isinstance(run.fence, int)
    assert [r.message_id for r in h.runs()].count(waiting.message_id) == 1


def test_run_unlocked_keeps_running_without_the_lock_redis(make_harness, lock_server, figure):
    # Given the opt-in policy that prefers availability
    h = make_harness("redis", FAULTS_LOCK_URL=lock_server.url, FAULTS_ON_BACKEND_ERROR="run_unlocked")
    h.workers(processes=1, threads=2)
    # When the lock Redis is down
    lock_server.stop()
    # Then a send with a client lock is enqueued without it
    queued = h.app.once.send("c")
    assert "unique_duplicate_of" not in queued.options
    # And both kinds of message run, unlocked: no fencing token
    running = h.app.hold.send("k")
    runs = [h.finished(queued.message_id), h.finished(running.message_id)]
    assert [r.fence for r in runs] == [None, None]
    # And every failure to lock was still counted
    errors = h.events("backend_error")
    figure("backend_errors", len(errors))
    assert {e["message_id"] for e in errors} >= {queued.message_id, running.message_id}


@pytest.mark.parametrize("loss", ["script_flush", "restart"])
def test_locking_survives_a_redis_that_forgot_its_scripts(make_harness, lock_server, figure, loss):
    # Given workers that have loaded the lock scripts, and a first fenced run
    h = make_harness("redis", FAULTS_LOCK_URL=lock_server.url, FAULTS_EVENTS="released,lock_lost,backend_error")
    h.workers(processes=1, threads=4)
    before = h.finished(h.app.hold.send("k").message_id)
    # (its run lock is released in the background: let it be, before the scripts go)
    wait_for(lambda: before.message_id in {e["message_id"] for e in h.events("released")}, what="the first release")
    lock_client = redis.Redis.from_url(lock_server.url)
    shas = [script.sha for script in h.app.unique.backend.scripts.values()]
    # When Redis loses its script cache, by SCRIPT FLUSH or by a restart
    if loss == "script_flush":
        lock_client.script_flush()
    else:
        lock_server.restart()
    assert lock_client.script_exists(*shas) == [False] * len(shas)
    # Then locking still works: client locks refuse duplicates...
    # (held at a gate: a run that ended before the second send would free the key, and rightly so)
    original = h.app.once.send("c", gate="once")
    assert h.app.once.send("c").options["unique_duplicate_of"] == original.message_id
    h.open_gate("once")
    # ...and run locks serialize one key
    sent = [h.app.hold.send("k", seconds=0.1) for _ in range(4)]
    runs = [h.finished(m.message_id) for m in [original, *sent]]
    after = [r for r in runs if r.actor == "hold"]
    assert overlaps(after) == []
    errors = h.events("backend_error")
    figure("backend_errors", len(errors))
    assert errors == []
    # And fencing tokens kept growing, though a restarted Redis forgot the last one
    assert min(r.fence for r in after) > before.fence


def attempts(h, message_id):
    return sum(1 for e in h.events("backend_error") if e["message_id"] == message_id)
