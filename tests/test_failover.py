"""Failover with replica acknowledgement (``min_replicas``): on a real
primary and replica, a lock taken and then lost with its primary, and
the same take made to fail closed by ``WAIT``.

The replica's process is paused (SIGSTOP) during the take and the
primary drops its link to it, so that replication cannot have reached
it: the loss is deterministic.  (A pause alone is not enough: the write
waits in the paused replica's socket buffer, and it reads it on waking.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Iterator, NamedTuple

import dramatiq
import pytest
import redis
from dramatiq import Worker
from dramatiq.brokers.stub import StubBroker

from dramatiq_unique import LockBackendError, UniqueMiddleware
from dramatiq_unique.backends.records import Copy
from dramatiq_unique.backends.redis import RedisBackend, TooFewReplicas
from dramatiq_unique.errors import ConfigurationError
from dramatiq_unique.settings import from_environment

from .conftest import free_port, start_redis_server

KEY = "failover:{digest}:run"


class Pair(NamedTuple):
    """A primary and its replica, each a process and a URL."""

    primary: subprocess.Popen[bytes]
    replica: subprocess.Popen[bytes]
    primary_url: str
    replica_url: str


def _synced(url: str) -> bool:
    info = redis.Redis.from_url(url).info("replication")
    return info.get("master_link_status") == "up"


def _online(url: str) -> bool:
    """Whether the primary's replica acknowledges a write (WAIT): a
    replica that just synced may say "up" before it does.
    """
    client = redis.Redis.from_url(url)
    client.set("failover:warm-up", 1)
    return bool(client.execute_command("WAIT", 1, 100) >= 1)


@pytest.fixture
def pair() -> Iterator[Pair]:
    primary_port, replica_port = free_port(), free_port()
    # Redis waits 5 s by default before a diskless sync, for more replicas to join.
    primary = start_redis_server(primary_port, "--repl-diskless-sync-delay", "0")
    replica = start_redis_server(replica_port, "--replicaof", "127.0.0.1", str(primary_port))
    pair = Pair(primary, replica, f"redis://127.0.0.1:{primary_port}/0", f"redis://127.0.0.1:{replica_port}/0")
    deadline = time.monotonic() + 10
    while not (_synced(pair.replica_url) and _online(pair.primary_url)):
        assert time.monotonic() < deadline, "the replica never synced"
        time.sleep(0.05)
    yield pair
    for process in (replica, primary):
        if process.poll() is None:
            os.kill(process.pid, signal.SIGCONT)
            process.kill()
        process.wait()


def _fail_over(pair: Pair) -> RedisBackend:
    """Kill the primary, let the replica run again, promote it, and
    return a second holder's backend on it.
    """
    pair.primary.kill()  # SIGKILL: no last words to the replica
    pair.primary.wait()
    os.kill(pair.replica.pid, signal.SIGCONT)
    promoted = redis.Redis.from_url(pair.replica_url)
    promoted.execute_command("REPLICAOF", "NO", "ONE")
    return RedisBackend(url=pair.replica_url)


def _cut(pair: Pair) -> None:
    """Pause the replica and drop the primary's link to it: no write
    from now on reaches it, even from its socket buffer.
    """
    os.kill(pair.replica.pid, signal.SIGSTOP)
    redis.Redis.from_url(pair.primary_url).execute_command("CLIENT", "KILL", "TYPE", "replica")


def _take(backend: RedisBackend, owner: str) -> bool:
    return backend.acquire(KEY, owner, ttl=60_000).acquired


def test_an_unacknowledged_lock_is_lost_with_its_primary(pair: Pair) -> None:
    """Without ``min_replicas``: the take succeeds, and after the
    failover a second holder takes the same key (the loss).
    """
    first = RedisBackend(url=pair.primary_url)
    _cut(pair)
    assert _take(first, "first")
    second = _fail_over(pair)
    assert _take(second, "second")


def test_a_take_no_replica_acknowledged_fails_closed(pair: Pair) -> None:
    """With ``min_replicas=1`` and the replica paused: the take raises
    within about the timeout and gives its lock back.
    """
    first = RedisBackend(url=pair.primary_url, min_replicas=1, min_replicas_timeout=100)
    _cut(pair)
    began = time.monotonic()
    with pytest.raises(TooFewReplicas) as raised:
        first.acquire(KEY, "first", ttl=60_000)
    took = time.monotonic() - began
    assert 0.09 <= took < 1.0, took
    assert isinstance(raised.value, LockBackendError)
    assert (raised.value.acked, raised.value.wanted, raised.value.given_back) == (0, 1, True)
    assert first.inspect(KEY) is None  # given back on the primary
    second = _fail_over(pair)
    assert _take(second, "second")  # the first holder never held it


def test_an_acknowledged_lock_survives_the_failover(pair: Pair) -> None:
    """With ``min_replicas=1`` and the replica running: after the
    failover the promoted replica holds the lock, and no second holder
    takes it.
    """
    first = RedisBackend(url=pair.primary_url, min_replicas=1, min_replicas_timeout=1000)
    assert _take(first, "first")
    os.kill(pair.replica.pid, signal.SIGSTOP)  # what reached it before the kill is all it has
    second = _fail_over(pair)
    assert not _take(second, "second")


def test_run_locks_fail_closed_on_the_grouped_path(pair: Pair) -> None:
    """``start`` and ``release_and_start`` (group commit) learn the ack
    count of the ``WAIT`` after their round trip.
    """
    backend = RedisBackend(url=pair.primary_url, min_replicas=1, min_replicas_timeout=50)
    copy = Copy(KEY, "m1")
    assert backend.start(KEY, "ok", ttl=60_000, limit=1, lock="while_executing", copy=copy).acquisition.acquired
    _cut(pair)
    with pytest.raises(TooFewReplicas):
        backend.start(KEY.replace("digest", "other"), "t1", ttl=60_000, limit=1, lock="x", copy=Copy("k", "m2"))
    releases, started = backend.release_and_start(
        [(KEY, "ok")], KEY, "t2", ttl=60_000, limit=1, lock="while_executing", copy=Copy(KEY, "m3")
    )
    assert isinstance(started, TooFewReplicas) and started.given_back
    assert [release.held for release in releases] == [True]  # type: ignore[union-attr]
    assert backend.inspect(KEY) is None


def test_a_send_through_the_middleware_fails_closed(pair: Pair) -> None:
    """``send()`` of an enqueue-locked actor raises LockBackendError
    and enqueues nothing; a delivery of a run-locked actor never runs.
    """
    broker = StubBroker()
    middleware = UniqueMiddleware(redis_url=pair.primary_url, min_replicas=1, min_replicas_timeout=50)
    broker.add_middleware(middleware)
    ran: list[int] = []

    @dramatiq.actor(broker=broker, lock="until_executing", queue_name="sends")
    def send_once(n: int) -> None:
        ran.append(n)

    @dramatiq.actor(broker=broker, lock="while_executing", queue_name="runs", max_retries=0)
    def run_once(n: int) -> None:
        ran.append(n)

    run_once.send(1)  # its enqueue takes no lock
    _cut(pair)
    try:
        with pytest.raises(LockBackendError, match="replicas"):
            send_once.send(2)
        assert broker.queues["sends"].qsize() == 0
        worker = Worker(broker, worker_threads=1, worker_timeout=50)
        worker.start()
        try:
            broker.join("runs", fail_fast=False)
        finally:
            worker.stop()
    finally:
        os.kill(pair.replica.pid, signal.SIGCONT)
    assert ran == []
    assert len(broker.dead_letters) == 1


def test_the_settings_are_read_like_the_others() -> None:
    assert from_environment({}).min_replicas == 0
    assert from_environment({}).min_replicas_timeout == 100
    got = from_environment({"DRAMATIQ_UNIQUE_MIN_REPLICAS": "2", "dramatiq_unique_min_replicas_timeout": "250"})
    assert (got.min_replicas, got.min_replicas_timeout) == (2, 250)
    with pytest.raises(ConfigurationError, match="dramatiq_unique_min_replicas="):
        from_environment({"dramatiq_unique_min_replicas": "one"})
    with pytest.raises(ConfigurationError, match="dramatiq_unique_min_replicas_timeout="):
        from_environment({"dramatiq_unique_min_replicas_timeout": "0"})
    with pytest.raises(ConfigurationError, match="min_replicas="):
        RedisBackend(url="redis://127.0.0.1:1/0", min_replicas=-1)


def test_the_constructor_argument_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("dramatiq_unique_min_replicas", "3")
    middleware = UniqueMiddleware(redis_url="redis://127.0.0.1:1/0", min_replicas=1)
    assert middleware.settings.min_replicas == 1
    assert middleware.backend.min_replicas == 1  # type: ignore[union-attr]
