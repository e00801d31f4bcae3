"""Case 6: a holder whose lease ran out and was taken over, and the
fencing token that protects a downstream write from it.
"""

from __future__ import annotations

import time

from dramatiq_unique.backends.redis import RedisBackend
from tests.conftest import wait_for
from tests.faults.harness import stopped

KEY = "faults:stale:{digest}:run"


def server_ms(client):
    seconds, micros = client.time()
    return seconds * 1000 + micros // 1000


def test_a_stale_holder_cannot_release_or_extend_the_new_holders_lock(redis_client, monkeypatch):
    # Given a worker clock two hours off: deadlines must come from Redis alone
    backend = RedisBackend(client=redis_client)
    skewed = time.time() + 7200
    monkeypatch.setattr(time, "time", lambda: skewed)
    monkeypatch.setattr(time, "time_ns", lambda: int(skewed * 1e9))
    # And a holder whose short lease runs out
    stale = backend.acquire(KEY, "stale/1", ttl=300)
    deadline = redis_client.hget(KEY, "stale/1")
    assert abs(int(deadline) - (server_ms(redis_client) + 300)) < 100
    wait_for(lambda: backend.inspect(KEY) is None, timeout=3, what="the lease to run out on the server's clock")
    # When a new holder takes the key
    fresh = backend.acquire(KEY, "fresh/1", ttl=10_000)
    assert fresh.acquired and fresh.fence > stale.fence
    held_until = backend.inspect(KEY).holders["fresh/1"]
    # Then the stale holder can neither release nor extend it, nor take it back
    assert not backend.release(KEY, "stale/1").held
    assert backend.extend([(KEY, "stale/1")], 60_000) == [False]
    assert not backend.acquire(KEY, "stale/1", ttl=60_000).acquired
    # And the new holder's slot is untouched
    assert backend.inspect(KEY).holders == {"fresh/1": held_until}
    assert backend.release(KEY, "fresh/1").held


def test_the_fence_token_rejects_a_write_from_a_holder_paused_past_its_lease(make_harness, figure):
    # Given two worker processes, and a job for k that will write to a fenced store
    h = make_harness("redis")
    h.workers(processes=2, threads=1)
    paused = h.app.hold.send("k", gate="paused", write=True)
    first = h.started(paused.message_id)
    # When its process is frozen past its lease (SIGSTOP: a stand-in for a GC pause)
    with stopped(first.pid):
        stopped_at = time.time()
        # Then the other process takes the key, with a higher token, and writes
        taker = h.app.hold.send("k", write=True, then="taker")
        second = h.started(taker.message_id)
        wait_for(lambda: h.records.hget(f"{h.namespace}:store:k", "value") == taker.message_id.encode(),
                 what="the new holder's write")
        h.open_gate("paused")
    # And when the paused process wakes up and writes, the store refuses its stale token
    late = h.finished(paused.message_id)
    assert second.pid != first.pid and second.fence > first.fence
    assert late.written is False
    assert h.records.hget(f"{h.namespace}:store:k", "value") == taker.message_id.encode()
    # And the paused process reports its lease lost, once
    wait_for(lambda: h.events("lock_lost"), what="a lock_lost event")
    assert [e["message_id"] for e in h.events("lock_lost")] == [paused.message_id]
    # And its release left the new holder's lock alone
    key = h.events("lock_lost")[0]["key"]
    holders = h.app.unique.backend.inspect(key).holders
    assert [owner.split("/")[0] for owner in holders] == [taker.message_id]
    h.open_gate("taker")
    assert h.finished(taker.message_id).written is True
    figure("takeover_after_s", round(second.start - stopped_at, 3))
    figure("overlap_s", round(late.end - second.start, 3))
    figure("stale_writes_accepted", int(bool(late.written)))
