"""Case 5: a slow or cut network between a worker and the lock Redis,
through :class:`tests.faults.proxy.Proxy`.

Only the lock backend goes through the proxy; the broker and the
records use the suite's Redis directly, so the worker stays reachable
and its events get out.  Figure: ``detected_after_s``, from the fault
to the ``lock_lost`` event.
"""

from __future__ import annotations

import time

import pytest

from dramatiq_unique.backends.redis import RedisBackend
from tests.conftest import wait_for
from tests.faults.proxy import through

LEASE_S = 2.0
#: A failed renewal is retried every second (leases.RETRY_INTERVAL).
RETRY_S = 1.0


FAULTS = {
    "blackhole": lambda proxy: proxy.blackhole(),
    "cut": lambda proxy: proxy.cut(),
    # slower each way than a whole lease: every renewal answers too late
    "latency": lambda proxy: proxy.set_latency(int(LEASE_S * 750)),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_worker_cut_off_from_redis_reports_its_lease_lost(make_harness, proxy, redis_url, figure, fault):
    # Given a worker that reaches the lock Redis through the proxy, running a job that holds key k
    h = make_harness("redis", FAULTS_LOCK_URL=through(proxy, redis_url))
    group = h.workers(processes=1, threads=2)
    holder = h.app.hold.send("k", gate="holder")
    h.started(holder.message_id)
    # When the network to Redis goes silent, is reset, or slows down past the lease
    FAULTS[fault](proxy)
    faulted_at = time.time()
    # Then the worker reports the lease lost: one lock_lost event and an ERROR naming the key
    wait_for(lambda: h.events("lock_lost"), timeout=LEASE_S * 5, what="a lock_lost event")
    lost = h.events("lock_lost")
    detected = lost[0]["at"] - faulted_at
    figure("detected_after_s", round(detected, 3))
    assert [e["message_id"] for e in lost] == [holder.message_id]
    assert LEASE_S * 2 / 3 - 0.05 <= detected <= LEASE_S + RETRY_S
    key = lost[0]["key"]
    wait_for(lambda: f"[ERROR] Lock {key!r} was lost" in group.output(), what="the ERROR log line")
    # And the key is free for others: nobody holds it any more (the server's deadline
    # follows the worker's by the latency of the call that took the lock: well under 0.5 s)
    wait_for(lambda: RedisBackend(url=redis_url).inspect(key) is None, timeout=0.5, what="the key to be free")
    # And once the network heals the job still finishes, without reporting the loss twice
    proxy.heal()
    h.open_gate("holder")
    h.finished(holder.message_id)
    assert len(h.events("lock_lost")) == 1


def test_a_slow_network_keeps_the_lease(make_harness, proxy, redis_url, figure):
    # Given 25 ms of latency each way between the worker and the lock Redis: a
    # new connection's handshake then takes about 6 round trips, 300 ms, well
    # inside lease/3
    h = make_harness("redis", FAULTS_LOCK_URL=through(proxy, redis_url))
    h.workers(processes=1, threads=2)
    proxy.set_latency(25)
    # When a job holds key k for three leases while another waits for it
    holder = h.app.hold.send("k", seconds=LEASE_S * 3)
    h.started(holder.message_id)
    follower = h.app.hold.send("k")
    # Then renewals keep up: no loss, and the follower starts only after the holder ended
    first, second = h.finished(holder.message_id), h.finished(follower.message_id, timeout=30)
    figure("lock_lost", len(h.events("lock_lost")))
    assert h.events("lock_lost") == [] and h.events("backend_error") == []
    assert second.start >= first.end
