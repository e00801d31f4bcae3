"""dramatiq-unique on a real three-node Redis Cluster, and through a
real Sentinel.

The backend contract (every test of ``tests/test_backends.py`` that
takes only ``backend``, ``redis_backend`` and ``redis_client``) and the
lifecycle suite (every test of ``tests/test_lifecycle.py`` that takes
only ``rig``) run here again, against a ``RedisBackend`` whose client
is a ``RedisCluster``; the fixtures below replace the standalone ones.
"""

from __future__ import annotations

import inspect
import time
import uuid
from typing import Any, Callable, Iterator

import dramatiq
import pytest
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware import AsyncIO
from redis.cluster import RedisCluster
from redis.sentinel import Sentinel

from dramatiq_unique.backends import from_url
from dramatiq_unique.backends.redis import RedisBackend
from tests import test_backends, test_lifecycle, test_replace
from tests.cluster import Servers, WholeCluster, start_cluster, start_sentinel
from tests.conftest import make_worker, unique, wait_for


def _borrowed(module: Any, fixtures: set[str]) -> dict[str, Callable[..., Any]]:
    """The tests of ``module`` that need no fixture outside ``fixtures``
    (parameters filled by ``parametrize`` do not count).
    """
    found = {}
    for name, test in vars(module).items():
        if not name.startswith("test_") or not callable(test):
            continue
        marks = getattr(test, "pytestmark", [])
        given = {arg.strip() for m in marks if m.name == "parametrize" for arg in str(m.args[0]).split(",")}
        if set(inspect.signature(test).parameters) - given <= fixtures:
            found[name] = test
    return found


CONTRACT = _borrowed(test_backends, {"backend", "redis_backend", "redis_client"})
LIFECYCLE = _borrowed(test_lifecycle, {"rig"})
REPLACE_CONTRACT = _borrowed(test_replace, {"backend"})
globals().update(CONTRACT)
globals().update(LIFECYCLE)
globals().update(REPLACE_CONTRACT)


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[list[int]]:
    """The ports of a fresh three-primary Redis Cluster."""
    servers = Servers()
    try:
        yield start_cluster(servers)
    finally:
        servers.stop()


@pytest.fixture
def cluster_client(redis_cluster: list[int]) -> Iterator[RedisCluster]:
    """A ``RedisCluster`` client on an emptied cluster."""
    client = WholeCluster(host="127.0.0.1", port=redis_cluster[0])
    client.flushall(target_nodes=RedisCluster.PRIMARIES)
    yield client
    client.flushall(target_nodes=RedisCluster.PRIMARIES)
    client.close()


@pytest.fixture(scope="module")
def redis_sentinel() -> Iterator[tuple[int, str]]:
    """The port of a Sentinel watching a fresh primary, and the name
    it knows the primary by.
    """
    servers = Servers()
    try:
        yield start_sentinel(servers, "locks"), "locks"
    finally:
        servers.stop()


@pytest.fixture
def redis_client(cluster_client: RedisCluster) -> RedisCluster:
    return cluster_client


@pytest.fixture
def redis_backend(cluster_client: RedisCluster) -> RedisBackend:
    return RedisBackend(client=cluster_client)


@pytest.fixture
def backend(redis_backend: RedisBackend) -> RedisBackend:
    return redis_backend


@pytest.fixture
def rig(redis_url: str, redis_client: RedisCluster, redis_backend: RedisBackend) -> Iterator[test_lifecycle.Rig]:
    """The lifecycle rig on a ``RedisBroker`` (standalone Redis) whose
    locks live on the Cluster.
    """
    broker = RedisBroker(url=redis_url, namespace=f"t-{uuid.uuid4().hex[:8]}")
    broker.emit_after("process_boot")
    dramatiq.set_broker(broker)
    broker.add_middleware(AsyncIO())
    middleware = unique(redis_backend)
    broker.add_middleware(middleware)
    r = test_lifecycle.Rig(broker, middleware)
    yield r
    if r.worker is not None:
        r.worker.stop()
    for key in broker.client.scan_iter(f"{broker.namespace}*"):
        broker.client.delete(key)
    broker.close()


def test_a_cluster_url_makes_a_backend_without_what_a_cluster_cannot_do(redis_cluster, cluster_client):
    backend = from_url(f"redis+cluster://127.0.0.1:{redis_cluster[0]}")
    assert isinstance(backend, RedisBackend) and backend.cluster
    # one script cannot touch two slots, nor a pipeline carry a start across nodes, nor a RESP socket follow moves
    assert backend.dispatch_client is None and not backend.batches_releases and backend.native_extender() is None
    assert backend.acquire("c:{1}:run", "o", ttl=10_000).acquired and backend.delete_prefix("c:") == 1
    backend.close()


def test_the_contract_and_lifecycle_suites_were_borrowed_whole():
    # Every contract test on `backend` and every lifecycle test on `rig` runs here too.
    takes = lambda module, name: [n for n, t in vars(module).items()  # noqa: E731
                                  if n.startswith("test_") and name in inspect.signature(t).parameters]
    assert set(takes(test_backends, "backend")) <= set(CONTRACT) and len(CONTRACT) >= 16
    assert set(takes(test_lifecycle, "rig")) <= set(LIFECYCLE) and len(LIFECYCLE) >= 20


def _node_of(client: RedisCluster, key: str) -> str:
    return client.get_node_from_key(key).name


def _keys_on_every_node(client: RedisCluster, count_per_node: int = 2) -> list[str]:
    """Lock keys spread so that every node holds ``count_per_node``."""
    per_node: dict[str, list[str]] = {}
    for n in range(10_000):
        key = f"test:actor:{{{n:032x}}}:run"
        chosen = per_node.setdefault(_node_of(client, key), [])
        if len(chosen) < count_per_node:
            chosen.append(key)
        if len(per_node) == 3 and all(len(k) == count_per_node for k in per_node.values()):
            break
    return [key for keys in per_node.values() for key in keys]


def test_extend_renews_leases_on_every_node_in_one_call(redis_backend, cluster_client):
    # Given six leases of 300 ms spread over the three nodes
    keys = _keys_on_every_node(cluster_client)
    assert len({_node_of(cluster_client, key) for key in keys}) == 3
    for key in keys:
        assert redis_backend.acquire(key, "a", ttl=300).acquired
    # When they are renewed together for a second, along with a stranger
    for _ in range(10):
        time.sleep(0.1)  # renewal interval: the behaviour under test is that leases outlive their ttl
        assert redis_backend.extend([(key, "a") for key in keys] + [(keys[0], "b")], 300) == [True] * 6 + [False]
    # Then every lease is still held after three times its ttl
    assert all(not redis_backend.acquire(key, "b", ttl=1000).acquired for key in keys)


def test_the_keys_of_one_lock_share_a_slot(cluster_client):
    # The lock hash, its waiters, bodies and message records must be reachable by one script.
    middleware = unique(RedisBackend(client=cluster_client))
    key = f"{middleware.settings.prefix}:sync_{{account}}:{{{'f' * 32}}}:run"
    slots = {cluster_client.keyslot(name) for name in (key, f"{key}:wait", f"{key}:bodies", f"{key}:m:some-message-id")}
    assert len(slots) == 1
    queue = key.replace(":run", ":queue")
    assert {cluster_client.keyslot(name) for name in (queue, f"{queue}:superseded")} == slots
    assert len(REPLACE_CONTRACT) >= 6


def test_a_cluster_url_connects_through_any_node(redis_cluster):
    # Given one backend per node, each from a cluster URL
    backends = [RedisBackend(url=f"redis+cluster://127.0.0.1:{port}") for port in redis_cluster]
    assert all(isinstance(backend.client, RedisCluster) for backend in backends)
    assert backends[0].describe() == f"RedisBackend(redis+cluster://127.0.0.1:{redis_cluster[0]})"
    # Then a lock taken through one node is seen through the others
    key = f"url-test:actor:{{{uuid.uuid4().hex}}}:queue"
    assert backends[0].acquire(key, "a", ttl=10_000).acquired
    assert [b.acquire(key, "b", ttl=10_000).holder for b in backends[1:]] == ["a", "a"]
    assert backends[2].release(key, "a").held


def test_a_client_backend_describes_its_cluster(cluster_client):
    node = cluster_client.get_default_node()
    assert RedisBackend(client=cluster_client).describe() == f"RedisBackend(cluster at {node.host}:{node.port})"


def test_leases_on_the_cluster_survive_long_runs_without_overlap(redis_url, cluster_client):
    # Given locks on the Cluster with a 300 ms lease and runs of 1 s on three keys
    broker = RedisBroker(url=redis_url, namespace=f"t-{uuid.uuid4().hex[:8]}")
    broker.emit_after("process_boot")
    middleware = unique(RedisBackend(client=cluster_client), lease=300, reschedule_delay=100)
    broker.add_middleware(middleware)
    spans: list[tuple[int, float, float]] = []

    def sync(account_id: int) -> None:
        began = time.monotonic()
        time.sleep(1.0)
        spans.append((account_id, began, time.monotonic()))

    actor = dramatiq.actor(sync, broker=broker, actor_name=f"sync_{uuid.uuid4().hex[:6]}", lock="while_executing")
    for account in (1, 1, 2, 2, 3, 3):
        actor.send(account)
    worker = make_worker(broker, threads=6)
    try:
        # When every run completes
        wait_for(lambda: len(spans) == 6, timeout=30, what="six runs")
    finally:
        worker.stop()
        for key in broker.client.scan_iter(f"{broker.namespace}*"):
            broker.client.delete(key)
        broker.close()
    # Then no lease was lost, runs per key never overlapped, and keys ran alongside
    assert middleware.events.count("lock_lost") == 0
    assert middleware.events.count("locked") == 6 and middleware.events.count("released") == 6
    for account in (1, 2, 3):
        mine = sorted((s, e) for k, s, e in spans if k == account)
        assert mine[1][0] >= mine[0][1], f"runs of {account} overlapped: {mine}"
    firsts = sorted(min(s for k, s, _ in spans if k == account) for account in (1, 2, 3))
    assert firsts[-1] - firsts[0] < 1.0


def test_a_backend_through_sentinel_follows_its_primary(redis_sentinel):
    # Given the client of a Sentinel-monitored primary, as the docs show
    port, service = redis_sentinel
    sentinel = Sentinel([("127.0.0.1", port)], socket_timeout=0.5)
    backend = RedisBackend(client=sentinel.master_for(service, socket_timeout=0.5))
    key = f"sentinel:actor:{{{uuid.uuid4().hex}}}:run"
    # Then locks behave as on any Redis
    assert backend.acquire(key, "a", ttl=10_000).acquired
    assert backend.acquire(key, "b", ttl=10_000).holder == "a"
    assert backend.extend([(key, "a"), (key, "b")], 10_000) == [True, False]
    assert backend.inspect(key).holders.keys() == {"a"}
    assert backend.release(key, "a").held and backend.inspect(key) is None
    assert backend.describe() == f"RedisBackend(sentinel service {service})"


def test_operators_list_inspect_and_release_locks_on_the_cluster(redis_backend):
    from dramatiq_unique.ops.admin import LockAdmin

    # Given locks of one actor spread over every node, and one of another actor
    admin = LockAdmin(redis_backend, prefix="ops")
    digests = [f"{n:032x}" for n in range(12)]
    for digest in digests:
        redis_backend.acquire(f"ops:sync:{{{digest}}}:queue", "m1", ttl=10_000, lock="until_executed")
    redis_backend.acquire(f"ops:other:{{{'f' * 32}}}:run", "m2/1", ttl=10_000, lock="while_executing")
    # Then SCAN over the whole cluster finds them all, by actor
    assert sorted(lock.digest for lock in admin.locks(actor="sync")) == digests
    [held] = admin.inspect(digests[3])
    assert held.lock == "until_executed" and [h.message_id for h in held.holders] == ["m1"]
    # And releasing by actor frees exactly that actor's locks, on every node
    assert len(admin.release_actor("sync")) == len(digests)
    assert list(admin.locks(actor="sync")) == [] and len(list(admin.locks())) == 1
