"""Run locks released off the worker thread, and the run lock of
``until_and_while_executing`` taken with its enqueue lock released in
one call.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Sequence, Union

import dramatiq
import pytest
from dramatiq import Worker
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware.time_limit import TimeLimitExceeded

from dramatiq_unique.backends.records import Release
from dramatiq_unique.backends.redis import RedisBackend
from dramatiq_unique.worker.leases import HandOff
from dramatiq_unique.worker.release import PendingRelease, Releaser

from .conftest import make_worker, unique, wait_for


class SlowBackend(RedisBackend):
    """Releases for real, but only once ``gate`` is set; records every call."""

    def __init__(self, client: Any) -> None:
        super().__init__(client=client)
        self.gate = threading.Event()
        self.sent: list[tuple[str, str]] = []

    def release_many(self, locks: Sequence[tuple[str, str]]) -> list[Union[Release, Exception]]:
        self.gate.wait(10)
        self.sent += [(lock[0], lock[1]) for lock in locks]
        return super().release_many(locks)


def pending(key: str, owner: str) -> PendingRelease:
    return PendingRelease(key, owner, "actor")


class Outcomes(list):  # type: ignore[type-arg]
    """Where a releaser reports: the outcomes, in the order reported."""

    def released(self, pending: PendingRelease, outcome: Any) -> None:
        self.append(outcome)

    def hand_over(self, handoff: HandOff) -> None:
        raise AssertionError(f"no key is handed over here: {handoff}")


def test_every_release_is_sent_once_and_reported_once(redis_client):
    # Given 400 held locks and a releaser
    backend = SlowBackend(redis_client)
    backend.gate.set()
    locks = [(f"t:{{{i}}}:run", f"m{i}/0") for i in range(400)]
    for key, owner in locks:
        backend.acquire(key, owner, ttl=60_000)
    outcomes = Outcomes()
    releaser = Releaser(backend, on_stalled=lambda batch: None, reports=outcomes)
    # When 8 threads submit their releases at once
    threads = [threading.Thread(target=lambda part=locks[i::8]: [releaser.submit(pending(*lock))
                                                                    for lock in part]) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert releaser.drain(10_000)
    # Then each lock was released exactly once, in batches, and every one was held until then
    assert sorted(backend.sent) == sorted(locks)
    assert len(outcomes) == 400 and all(isinstance(o, Release) and o.held for o in outcomes)
    assert not any(redis_client.exists(key) for key, _ in locks)
    releaser.stop()


def test_a_stalled_backend_is_reported_without_stalling_the_submitters(redis_client):
    # Given a backend that does not answer
    backend = SlowBackend(redis_client)
    backend.acquire("t:{a}:run", "a/0", ttl=60_000)
    backend.acquire("t:{b}:run", "b/0", ttl=60_000)
    backend.acquire("t:{c}:run", "c/0", ttl=60_000)
    stalled: list[list[PendingRelease]] = []
    outcomes = Outcomes()
    releaser = Releaser(backend, on_stalled=stalled.append, stall_after=50, reports=outcomes)
    releaser.submit(pending("t:{a}:run", "a/0"))
    wait_for(lambda: releaser.pending() == 1 and not releaser._pending, what="the first batch in flight")
    # When a worker submits another release after the stall threshold
    time.sleep(0.1)
    started = time.monotonic()
    releaser.submit(pending("t:{b}:run", "b/0"))
    # Then it returns at once, and the stuck batch is reported, once
    assert time.monotonic() - started < 0.05
    assert [[p.key for p in batch] for batch in stalled] == [["t:{a}:run"]]
    releaser.submit(pending("t:{c}:run", "c/0"))
    assert len(stalled) == 1
    # And a stop that cannot drain gives up after its timeout, and returns what is left, stuck batch first
    started = time.monotonic()
    left = releaser.stop(timeout=100)
    assert time.monotonic() - started < 1
    assert [p.key for p in left] == ["t:{a}:run", "t:{b}:run", "t:{c}:run"]
    # And once the backend answers, everything is released and reported
    backend.gate.set()
    wait_for(lambda: len(outcomes) == 3, what="the releases")
    assert [o.held for o in outcomes] == [True, True, True]


def test_a_worker_shutdown_drains_the_pending_releases(redis_client, stub_broker):
    # Given a Redis lock backend and a while_executing job that has just run
    backend = SlowBackend(redis_client)
    middleware = unique(backend, prefix="drain")
    stub_broker.add_middleware(middleware)
    ran = threading.Event()

    @dramatiq.actor(broker=stub_broker, lock="while_executing", lock_args=["key"])
    def job(key: int) -> None:
        ran.set()

    worker = make_worker(stub_broker, threads=2)
    job.send(1)
    assert ran.wait(10)
    threads = middleware.threads
    wait_for(lambda: backend.sent == [] and threads.releaser is not None and threads.releaser.pending() == 1,
             what="the release to be pending")
    # When the worker shuts down while the backend answers slowly
    threading.Timer(0.2, backend.gate.set).start()
    worker.stop()
    # Then the shutdown waited for the release
    assert [key for key, _ in backend.sent] == ["drain:job:{%s}:run" % job_digest(middleware, job)]
    assert redis_client.keys("drain:*") == []


def job_digest(middleware: Any, actor: Any) -> str:
    return str(middleware.specs[actor.actor_name].digest((1,), {}))


def test_after_a_hand_off_the_redis_consumer_polls_quickly_for_a_while(redis_url, redis_client):
    # Given a Redis broker whose worker backs off up to 1 s, and three same-key jobs
    broker = RedisBroker(url=redis_url, namespace="t-handoff")
    broker.emit_after("process_boot")
    middleware = unique(prefix="t-handoff")
    broker.add_middleware(middleware)
    middleware.threads.handoffs.hold = 1_500
    ran: list[tuple[int, float, float]] = []

    @dramatiq.actor(broker=broker, lock="while_executing", lock_args=["key"])
    def job(key: int, seq: int) -> None:
        started = time.monotonic()
        time.sleep(0.05)
        ran.append((seq, started, time.monotonic()))

    for seq in range(3):
        job.send(1, seq)
    worker = Worker(broker, worker_timeout=1_000, worker_threads=4)
    worker.start()
    try:
        consumer = worker.consumers["default"]
        # When a hand-off has happened
        wait_for(lambda: len(ran) >= 2, what="a hand-off")
        # Then the queue's consumer polls at least every 5 ms
        assert consumer.consumer.timeout == 5
        # And once no hand-off has followed for a while, its own backoff is back
        wait_for(lambda: len(ran) == 3, what="every job")
        wait_for(lambda: consumer.consumer.timeout == 1_000, timeout=5, what="the backoff to come back")
    finally:
        worker.stop()
        broker.close()
    # And the jobs ran one at a time, each once
    ordered = sorted(ran, key=lambda run: run[1])
    assert sorted(seq for seq, _, _ in ran) == [0, 1, 2]
    assert all(b[1] >= a[2] for a, b in zip(ordered, ordered[1:]))


def test_a_forked_child_leaves_the_parents_releases_to_the_parent_and_sends_its_own(redis_client):
    # Given a releaser with a release pending in the parent (it lingers a minute for a start to carry it)
    backend = RedisBackend(client=redis_client)
    for key in ("t:{parent}:run", "t:{child}:run"):
        assert backend.acquire(key, key, ttl=60_000).acquired
    outcomes = Outcomes()
    releaser = Releaser(backend, on_stalled=lambda batch: None, linger=60_000, reports=outcomes)
    releaser.submit(pending("t:{parent}:run", "t:{parent}:run"))
    read, write = os.pipe()
    # When the process forks, and the child submits a release of its own and drains
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        left_at_fork = releaser.pending()
        releaser.submit(pending("t:{child}:run", "t:{child}:run"))
        drained = releaser.drain(5_000)
        held = [redis_client.exists(key) for key in ("t:{child}:run", "t:{parent}:run")]
        state = f"{left_at_fork}:{drained}:{held[0]}:{held[1]}"
        os.write(write, state.encode())
        os._exit(0)
    os.close(write)
    os.waitpid(child, 0)
    # Then the child had none of the parent's releases, sent its own, and left the parent's lock alone
    assert os.read(read, 100).decode() == "0:True:0:1"
    # And the parent still sends its own
    assert releaser.pending() == 1 and releaser.drain(5_000)
    assert [outcome.held for outcome in outcomes] == [True] and not redis_client.exists("t:{parent}:run")
    releaser.stop()


class HandsOverNow(Outcomes):
    """Reports outcomes, and hands over the key of ``t:{now}:run``,
    recording the thread that does it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.handed_over_on: list[threading.Thread] = []

    def released(self, pending: PendingRelease, outcome: Any) -> Any:
        self.append(outcome)
        return HandOff(None, pending.key, b"") if pending.key == "t:{now}:run" else None  # type: ignore[arg-type]

    def hand_over(self, handoff: HandOff) -> None:
        self.handed_over_on.append(threading.current_thread())


def test_a_release_sent_now_goes_on_the_calling_thread_with_the_pending_ones_and_hands_over_there(redis_client):
    # Given a releaser that lingers a minute, with one release pending
    backend = SlowBackend(redis_client)
    backend.gate.set()
    for key in ("t:{pending}:run", "t:{now}:run"):
        assert backend.acquire(key, key, ttl=60_000).acquired
    reports = HandsOverNow()
    releaser = Releaser(backend, on_stalled=lambda batch: None, linger=60_000, reports=reports)
    releaser.submit(pending("t:{pending}:run", "t:{pending}:run"))
    # When a release is sent now (the run of a message that waited for its key)
    releaser.release_now(pending("t:{now}:run", "t:{now}:run"))
    # Then both were sent in one round trip before it returned, the pending one first, and reported
    assert backend.sent == [("t:{pending}:run", "t:{pending}:run"), ("t:{now}:run", "t:{now}:run")]
    assert [outcome.held for outcome in reports] == [True, True]
    assert not redis_client.exists("t:{pending}:run") and not redis_client.exists("t:{now}:run")
    # And what its report left to do (the hand-off) was done on the calling thread, leaving nothing pending
    assert reports.handed_over_on == [threading.current_thread()]
    assert releaser.pending() == 0
    releaser.stop()


class InterruptedOnce(RedisBackend):
    """Releases for real, but the first call is broken by a time limit
    after it was applied, as an interrupt meant for the worker thread
    would break it.
    """

    def __init__(self, client: Any) -> None:
        super().__init__(client=client)
        self.release_calls = 0

    def release_many(self, locks: Sequence[tuple[str, str]]) -> list[Union[Release, Exception]]:
        self.release_calls += 1
        outcomes = super().release_many(locks)
        if self.release_calls == 1:
            raise TimeLimitExceeded()
        return outcomes


def test_a_release_sent_now_that_an_interrupt_breaks_is_sent_again_by_the_releaser_thread(redis_client):
    # Given a held lock, and a backend whose first release call an interrupt breaks after it was applied
    backend = InterruptedOnce(redis_client)
    assert backend.acquire("t:{i}:run", "t:{i}:run", ttl=60_000).acquired
    outcomes = Outcomes()
    releaser = Releaser(backend, on_stalled=lambda batch: None, linger=60_000, reports=outcomes)
    # When it is released now, and the interrupt breaks the call
    with pytest.raises(TimeLimitExceeded):
        releaser.release_now(pending("t:{i}:run", "t:{i}:run"))
    # Then the releaser thread sends it again at once, and the release found done is not reported as lost
    assert releaser.drain(5_000)
    assert backend.release_calls == 2 and outcomes == [] and not redis_client.exists("t:{i}:run")
    releaser.stop()
