"""Checks of what the harness could get silently wrong: counting round
trips, and telling a correct run from a broken one.

Run with ``python -m pytest benchmarks``.  They use ``REDIS_URL`` when
it is set, else a private ``redis-server``.
"""

from __future__ import annotations

import os
import uuid
from typing import Any, Iterator

import pytest
import redis

from dramatiq_unique.backend import Copy
from dramatiq_unique.backends.redis import RedisBackend

from . import trips
from .runs import Executions
from .server import BenchmarkError, PrivateRedis, cleanup, connect


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    try:
        server = PrivateRedis().start()
    except BenchmarkError as e:
        pytest.fail(str(e))
    yield server.url
    server.stop()


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    try:
        client = connect(redis_url)
    except BenchmarkError as e:
        pytest.fail(str(e))
    yield client
    client.close()


@pytest.fixture
def namespace(client: redis.Redis) -> Iterator[str]:
    namespace = f"bench-test-{uuid.uuid4().hex[:8]}"
    yield namespace
    cleanup(client, namespace)


@pytest.fixture
def counting() -> Iterator[None]:
    trips.reset()
    trips.install()
    yield
    trips.uninstall()


def test_a_pipeline_is_one_round_trip_and_scripts_are_told_apart(
    client: redis.Redis, namespace: str, counting: None
) -> None:
    # Given a lock backend on the same client, its script already loaded
    key = f"{namespace}:job:{{1}}:run"
    backend = RedisBackend(client=client)
    backend.acquire(key, "owner/0", ttl=1000)
    trips.reset()
    # When a transaction, a lock script and a plain command are sent
    with client.pipeline() as pipe:
        pipe.set(f"{key}:x", 1)
        pipe.get(f"{key}:x")
        pipe.execute()
    backend.acquire(key, "owner/1", ttl=1000)
    client.ping()
    # Then each is one round trip, named by what it carries
    counted = trips.counts()
    assert counted["MULTI+SET+GET+EXEC"] == 1
    assert counted["lock:acquire"] == 1
    assert counted["PING"] == 1
    assert trips.owner("lock:acquire") == "lock" and trips.owner("MULTI+SET+EXEC") == "mutex"


def test_a_run_lock_round_trip_is_named_by_what_it_carries(client: redis.Redis, namespace: str, counting: None) -> None:
    # Given a held run lock
    backend = RedisBackend(client=client)
    held, key = f"{namespace}:job:{{1}}:run", f"{namespace}:job:{{2}}:run"
    options: dict[str, Any] = {"ttl": 1000, "limit": 1, "lock": "while_executing", "copy": Copy(key, "b", 0, "")}
    for owner in ("z/0", "a/0"):
        backend.acquire(held, owner, ttl=1000, limit=2)
    backend.release_and_start([(held, "z/0")], f"{namespace}:job:{{3}}:run", "c/0", **options)  # loads the scripts
    trips.reset()
    # When a start carries the release of the held lock
    released, started = backend.release_and_start([(held, "a/0")], key, "b/0", **options)
    # Then it is one round trip, named as a start carrying releases
    assert trips.counts() == {"lock:start +releases": 1}
    assert trips.label([b"*1\r\n$4\r\nPING\r\n"]) == "PING"
    assert trips.owner("lock:start (grouped) +releases") == "lock"
    assert not isinstance(started, Exception) and started.acquisition.acquired
    assert [getattr(outcome, "held", None) for outcome in released] == [True]


def test_nothing_is_counted_once_uninstalled(client: redis.Redis, counting: None) -> None:
    trips.uninstall()
    client.ping()
    assert "PING" not in trips.counts()


def test_a_double_run_and_an_overlap_are_caught() -> None:
    # Given three sends
    serial = Executions(3, [(0, 0.0, 1.0), (1, 1.0, 2.0), (2, 2.5, 3.0)])
    twice = Executions(3, [(0, 0.0, 1.0), (1, 1.0, 2.0), (1, 2.5, 3.0)])
    overlapping = Executions(3, [(0, 0.0, 1.0), (1, 0.5, 2.0), (2, 2.5, 3.0)])
    # Then only the serial run passes
    assert serial.exactly_once and serial.overlaps == 0 and serial.seconds == 3.0
    assert not twice.exactly_once
    assert overlapping.exactly_once and overlapping.overlaps == 1
