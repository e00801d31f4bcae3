"""The backend seam: ``dramatiq_unique.backends.from_url`` makes a backend
from a URL by its scheme, every place that takes a URL goes through it,
and an actor whose options need a capability its backend lacks is
refused when it is declared.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Iterator, Optional, Sequence

import dramatiq
import pytest
import redis
from dramatiq import Worker

from dramatiq_unique import ConfigurationError, StubBackend, UniqueMiddleware
from dramatiq_unique.backends import from_url
from dramatiq_unique.backends.base import LockBackend
from dramatiq_unique.backends.capabilities import (
    BatchedReleases,
    MissingCapability,
    NewestWins,
    RenewsNatively,
    Reschedules,
    SendsWithPublish,
    capabilities,
)
from dramatiq_unique.backends.records import Acquisition, Copy, EnqueueRecord, LockInfo, Release, Start
from dramatiq_unique.backends.redis import RedisBackend
from dramatiq_unique.testing import assert_duplicate
from dramatiq_unique.worker.leases import native_extend

# The factory --------------------------------------------------------------


def test_a_redis_url_makes_a_redis_backend_with_the_options_given(redis_url, redis_client):
    backend = from_url(redis_url, min_replicas=0, socket_timeout=1.5)
    assert isinstance(backend, RedisBackend) and backend.describe() == f"RedisBackend({redis_url})"
    assert backend.client.connection_pool.connection_kwargs["socket_timeout"] == 1.5
    assert backend.acquire("url:a:{1}:run", "o", ttl=10_000).acquired  # it is the suite's Redis
    assert redis_client.exists("url:a:{1}:run")
    backend.close()


@pytest.mark.parametrize(
    "url, connection",
    [
        ("rediss://127.0.0.1:1/0", redis.SSLConnection),
        ("unix:///tmp/no-such-redis.sock?db=2", redis.UnixDomainSocketConnection),
    ],
)
def test_the_other_redis_schemes_make_a_redis_backend_without_connecting(url, connection):
    backend = from_url(url)
    assert isinstance(backend, RedisBackend)
    assert backend.client.connection_pool.connection_class is connection
    extender = native_extend(backend)  # a plain socket is mirrored on a native thread; TLS is not ours to mirror
    assert (extender is None) == (connection is redis.SSLConnection)


class StandInPostgres(StubBackend):
    """What ``backends.postgres`` must offer the factory (the interface
    agreed with it): ``PostgresBackend.from_url(url, **options)``.  A
    stand-in, in memory, until the real module is there.
    """

    made: list[tuple[str, dict[str, Any]]] = []

    @classmethod
    def from_url(cls, url: str, **options: Any) -> "StandInPostgres":
        cls.made.append((url, options))
        return cls()


@pytest.mark.parametrize("url", ["postgresql://app@db.internal:5432/locks", "postgres:///locks?host=/run/pg"])
def test_a_postgres_url_goes_to_postgres_backend_from_url(monkeypatch, url):
    module = types.ModuleType("dramatiq_unique.backends.postgres")
    module.PostgresBackend = StandInPostgres  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "dramatiq_unique.backends.postgres", module)
    StandInPostgres.made = []
    backend = from_url(url, min_replicas=1)
    assert isinstance(backend, StandInPostgres) and StandInPostgres.made == [(url, {"min_replicas": 1})]
    # and so does the middleware's url, which passes min_replicas only when it is asked for
    UniqueMiddleware(url=url)
    UniqueMiddleware(url=url, min_replicas=2, min_replicas_timeout=50)
    assert StandInPostgres.made[1:] == [(url, {}), (url, {"min_replicas": 2, "min_replicas_timeout": 50})]


def test_a_real_postgres_backend_when_there_is_one(postgres_url):
    url = postgres_url
    pytest.importorskip("dramatiq_unique.backends.postgres", reason="the PostgreSQL backend is not installed")
    backend = from_url(url)
    assert type(backend).__name__ == "PostgresBackend" and url.split("@")[-1] in backend.describe()
    backend.close()


@pytest.mark.parametrize("blocked", ["dramatiq_unique.backends.postgres", "psycopg"])
def test_a_missing_postgres_module_or_driver_names_the_extra(monkeypatch, blocked):
    for name in [name for name in sys.modules if name.startswith("dramatiq_unique.backends.postgres")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, blocked, None)  # `import` of it raises ModuleNotFoundError
    with pytest.raises(ConfigurationError) as info:
        from_url("postgresql://127.0.0.1:1/locks")
    assert str(info.value).endswith("needs psycopg: pip install 'dramatiq-unique[postgres]'")


@pytest.mark.parametrize(
    "url, says",
    [
        ("http://h:6379", "expected a URL starting with redis://, rediss://, unix://, redis+cluster://, postgresql://"),
        ("mysql://u@h/db", "expected a URL starting with"),
        ("REDIS://h", "expected a URL starting with"),
        ("redis://h:99999/0", "expected a URL like redis://host:6379/0"),
        ("redis://[::1", "expected a URL like redis://host:6379/0"),
        ("postgresql://h:abc/locks", "expected a URL like postgresql://user@host:5432/dbname"),
        ("", "expected a non-empty string"),
        (5, "expected a non-empty string"),
    ],
)
def test_a_bad_url_is_refused_naming_the_argument(url, says):
    with pytest.raises(ConfigurationError) as info:
        from_url(url)
    assert str(info.value).startswith(f"url={url!r} is invalid: ") and says in str(info.value)


def test_a_bad_url_never_shows_its_password():
    with pytest.raises(ConfigurationError) as info:
        from_url("redis://app:s3cret@h:99999/0")
    assert "s3cret" not in str(info.value) and "app:***@h:99999" in str(info.value)


def test_the_middleware_names_the_argument_or_the_variable(monkeypatch):
    with pytest.raises(ConfigurationError, match=r"^url='http://h' is invalid: expected a URL starting with"):
        UniqueMiddleware(url="http://h")
    with pytest.raises(ConfigurationError, match=r"^redis_url='http://h' is invalid"):
        UniqueMiddleware(redis_url="http://h")
    monkeypatch.setenv("dramatiq_unique_url", "http://h")
    with pytest.raises(ConfigurationError, match=r"^Environment variable dramatiq_unique_url='http://h' is invalid"):
        UniqueMiddleware()


# The url setting and its older name ---------------------------------------


def test_url_and_redis_url_are_one_setting(monkeypatch, redis_url):
    assert UniqueMiddleware(url=redis_url, redis_url=redis_url).settings.url == redis_url
    assert UniqueMiddleware(redis_url=redis_url).settings.url == redis_url
    with pytest.raises(ConfigurationError, match=r"redis_url='redis://other:6379/0' is invalid: expected the same"):
        UniqueMiddleware(url=redis_url, redis_url="redis://other:6379/0")
    monkeypatch.setenv("DRAMATIQ_UNIQUE_REDIS_URL", redis_url)
    assert UniqueMiddleware().settings.url == redis_url
    monkeypatch.setenv("dramatiq_unique_url", "redis://other:6379/0")
    with pytest.raises(ConfigurationError, match="Environment variable DRAMATIQ_UNIQUE_REDIS_URL=.* is invalid: "
                                                 "expected the same as dramatiq_unique_url"):
        UniqueMiddleware()
    monkeypatch.setenv("dramatiq_unique_url", redis_url)
    assert isinstance(UniqueMiddleware().backend, RedisBackend)  # made from the URL at construction


# Capabilities -------------------------------------------------------------


class CoreOnly(LockBackend):
    """A backend with the core verbs only, and no capability: each verb
    is a StubBackend's.
    """

    def __init__(self) -> None:
        self.locks = StubBackend()

    def describe(self) -> str:
        return "CoreOnly(memory)"

    def acquire(self, key: str, owner: str, **options: Any) -> Acquisition:
        return self.locks.acquire(key, owner, **options)

    def start(self, key: str, owner: str, **options: Any) -> Start:
        return self.locks.start(key, owner, **options)

    def release(self, key: str, owner: str, **options: Any) -> Release:
        return self.locks.release(key, owner, **options)

    def extend(self, locks: Sequence[tuple[str, str]], ttl: int) -> list[bool]:
        return self.locks.extend(locks, ttl)

    def confirm(self, locks: Sequence[tuple[str, str, int]]) -> list[bool]:
        return self.locks.confirm(locks)

    def reap(self, key: str, owner: str, record: EnqueueRecord) -> bool:
        return self.locks.reap(key, owner, record)

    def delete(self, key: str) -> bool:
        return self.locks.delete(key)

    def delete_prefix(self, prefix: str) -> int:
        return self.locks.delete_prefix(prefix)

    def inspect(self, key: str) -> Optional[LockInfo]:
        return self.locks.inspect(key)

    def scan(self, pattern: str) -> Iterator[str]:
        return self.locks.scan(pattern)


def test_each_backend_says_what_it_can_do(redis_url):
    assert capabilities(CoreOnly()) == []
    assert capabilities(StubBackend()) == ["Reschedules", "NewestWins"]
    backend = RedisBackend(url=redis_url)
    assert capabilities(backend) == [
        "Reschedules", "NewestWins", "SendsWithPublish", "BatchedReleases", "RenewsNatively"
    ]
    assert isinstance(backend, SendsWithPublish) and backend.dispatch_client is backend.client
    assert isinstance(backend, BatchedReleases) and backend.batches_releases
    assert isinstance(backend, RenewsNatively)
    extender = backend.native_extender()
    assert extender is not None and extender([("no:{k}:run", "o")], 1_000, timeout=2_000) == [False]
    extender.close()


@pytest.mark.parametrize(
    "options, capability, words",
    [
        ({"lock": "while_executing"}, Reschedules, "on_conflict='reschedule' (the server side's default)"),
        ({"lock": "until_and_while_executing", "on_conflict": {"server": "reschedule"}}, Reschedules,
         "on_conflict='reschedule'"),
        ({"lock": "until_executed", "on_conflict": "replace"}, NewestWins, "on_conflict='replace'"),
        ({"debounce": 1_000}, NewestWins, "debounce"),
    ],
)
def test_an_actor_that_needs_a_capability_the_backend_lacks_is_refused_at_declaration(
    stub_broker, options, capability, words
):
    stub_broker.add_middleware(UniqueMiddleware(backend=CoreOnly()))
    with pytest.raises(MissingCapability) as info:
        dramatiq.actor(lambda account_id: None, actor_name="sync", broker=stub_broker, **options)
    message = str(info.value)
    assert words in message and "actor 'sync'" in message
    assert f"{capability.capability} ({capability.__name__})" in message and "CoreOnly(memory) has none" in message
    assert info.value.capability == capability.__name__ and info.value.backend == "CoreOnly(memory)"
    assert isinstance(info.value, ConfigurationError) and "sync" not in stub_broker.actors


def test_a_backend_that_lacks_what_a_declared_actor_needs_is_refused_when_set(stub_broker):
    unique = UniqueMiddleware(backend=StubBackend())
    stub_broker.add_middleware(unique)
    dramatiq.actor(lambda account_id: None, actor_name="sync", broker=stub_broker, lock="while_executing")
    kept = unique.backend
    with pytest.raises(MissingCapability, match="actor 'sync', with on_conflict='reschedule'"):
        unique.backend = CoreOnly()
    assert unique.backend is kept


def test_a_backend_with_the_core_only_locks_what_needs_no_capability(stub_broker):
    # Given a backend without any capability
    backend = CoreOnly()
    unique = UniqueMiddleware(backend=backend)
    stub_broker.add_middleware(unique)
    runs: list[int] = []

    @dramatiq.actor(broker=stub_broker, lock="until_executed")
    def sync(account_id: int) -> None:
        runs.append(account_id)

    @dramatiq.actor(broker=stub_broker, lock="while_executing", on_conflict="log")
    def report(account_id: int) -> None:
        runs.append(-account_id)

    # When the same send is made twice, and both actors run
    first = sync.send(42)
    assert_duplicate(sync.send(42), of=first)
    report.send(7)
    worker = Worker(stub_broker, worker_timeout=50)
    worker.start()
    try:
        stub_broker.join(sync.queue_name)
        worker.join()
    finally:
        worker.stop()
    # Then each ran once, the releases went on the worker thread, and every lock is gone
    assert sorted(runs) == [-7, 42]
    assert unique.threads.releaser is None and native_extend(backend) is None
    assert list(backend.scan("*")) == []


def test_a_stub_backend_copy_claims_as_the_core_reads_it():
    # A copy with no record may run on every backend: the core's start takes `copy`
    backend = CoreOnly()
    started = backend.start("c:{1}:run", "m/1", ttl=1_000, limit=1, lock="x", copy=Copy("c:{1}:run", "m", 2, "delay"))
    assert started.acquisition.acquired
