"""Prometheus metrics, scraped from real expositions: an in-process
``prometheus_client`` HTTP server, and Dramatiq's own ``Prometheus``
exposition over two ``dramatiq`` worker processes in multiprocess mode.

The worker processes import this module, so it imports
``prometheus_client`` only inside tests: imported at the top, it would
fix in-process values before Dramatiq's middleware switches the worker
to multiprocess mode, and the exposition would show nothing.
"""

from __future__ import annotations

import os
import threading
import time
import urllib.request
import uuid
from typing import Any, Iterator

import dramatiq
import pytest
import redis
from dramatiq.brokers.redis import RedisBroker
from dramatiq_unique import UniqueMiddleware
from dramatiq_unique.backends.redis import RedisBackend
from dramatiq_unique.ops.prometheus import LockMetrics
from tests.conftest import free_port, make_worker, unique, wait_for
from tests.procs import WorkerGroup

EVENTS = "dramatiq_unique_lock_events_total"
LEASES = "dramatiq_unique_leases_held"


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def total(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


def named(text: str, name: str) -> bool:
    from prometheus_client.parser import text_string_to_metric_families

    return any(sample.name == name for family in text_string_to_metric_families(text) for sample in family.samples)


# In process -----------------------------------------------------------------


@pytest.fixture
def exposition() -> Iterator[tuple[Any, str]]:
    """A registry served over HTTP by ``prometheus_client``."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    yield registry, f"http://127.0.0.1:{port}/metrics"
    server.shutdown()
    server.server_close()
    thread.join(5)


def test_events_are_counted_and_leases_gauged(stub_broker, exposition):
    # Given metrics on a middleware, served over HTTP
    registry, url = exposition
    middleware = unique(reschedule_delay=100)
    LockMetrics(middleware, registry=registry)
    stub_broker.add_middleware(middleware)
    gate = threading.Event()

    def sync(account_id):
        gate.wait(10)

    def report(account_id):
        pass

    runs = dramatiq.actor(sync, broker=stub_broker, actor_name=f"sync_{uuid.uuid4().hex[:6]}", lock="while_executing")
    sends = dramatiq.actor(report, broker=stub_broker, actor_name=f"report_{uuid.uuid4().hex[:6]}",
                           lock="until_executed")
    # When two keys run while a third delivery waits, and a send is refused
    for account in (1, 1, 2):
        runs.send(account)
    sends.send(7)
    sends.send(7)
    worker = make_worker(stub_broker, threads=4)
    try:
        wait_for(lambda: total(scrape(url), LEASES, actor_name=runs.actor_name) == 2, what="two leases held")
        wait_for(lambda: total(scrape(url), EVENTS, actor_name=runs.actor_name, event="rescheduled") >= 1,
                 what="the waiting delivery to be rescheduled")
        gate.set()
        wait_for(lambda: total(scrape(url), EVENTS, event="released", actor_name=runs.actor_name) == 3,
                 what="three runs")
    finally:
        gate.set()
        worker.stop()
    # Then the counters match what happened, by actor and event, and no lease is left
    text = scrape(url)
    assert total(text, LEASES, actor_name=runs.actor_name) == 0
    assert total(text, EVENTS, actor_name=runs.actor_name, event="locked") == 3
    assert total(text, EVENTS, actor_name=sends.actor_name, event="locked") == 1
    assert total(text, EVENTS, actor_name=sends.actor_name, event="duplicate") == 1
    assert total(text, EVENTS, actor_name=sends.actor_name, event="released") == 1
    assert total(text, EVENTS, event="lock_lost") == 0


def test_a_lost_lease_leaves_the_gauge(stub_broker):
    # Given a running actor whose lease an operator deletes
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    middleware = unique(lease=300)
    LockMetrics(middleware, registry=registry)
    stub_broker.add_middleware(middleware)
    gate = threading.Event()

    def sync(account_id):
        gate.wait(10)

    actor = dramatiq.actor(sync, broker=stub_broker, actor_name=f"sync_{uuid.uuid4().hex[:6]}", lock="while_executing")
    actor.send(1)
    worker = make_worker(stub_broker, threads=2)
    try:
        def value(name: str, **labels: str) -> Any:
            return registry.get_sample_value(name, {"actor_name": actor.actor_name, **labels})

        wait_for(lambda: value(LEASES) == 1, what="the lease")
        [key] = middleware.backend.scan("*:run")
        middleware.backend.delete(key)
        # Then the gauge drops when the loss is noticed, before the actor ends
        wait_for(lambda: value(EVENTS, event="lock_lost") == 1, what="the loss")
        assert value(LEASES) == 0
    finally:
        gate.set()
        worker.stop()


def test_metrics_go_to_the_default_registry_and_are_shared():
    # Two middlewares in one process count into the same default-registry series.
    import prometheus_client

    first, second = UniqueMiddleware(), UniqueMiddleware()
    LockMetrics(first)
    LockMetrics(second)
    actor = f"actor_{uuid.uuid4().hex[:6]}"
    from dramatiq_unique import LockEvent

    first.events.emit(LockEvent("duplicate", actor, "p:a:{d}:queue"))
    second.events.emit(LockEvent("duplicate", actor, "p:a:{d}:queue"))
    value = prometheus_client.REGISTRY.get_sample_value(EVENTS, {"actor_name": actor, "event": "duplicate"})
    assert value == 2


# Dramatiq's exposition, multiprocess --------------------------------------------


def worker_broker() -> None:
    """The broker of the worker processes, configured by environment
    variables (``dramatiq tests.test_prometheus:worker_broker``).
    """
    from dramatiq.middleware.prometheus import Prometheus

    namespace, url = os.environ["PROM_NAMESPACE"], os.environ["PROM_REDIS_URL"]
    broker = RedisBroker(url=url, namespace=namespace)
    broker.add_middleware(Prometheus())
    middleware = UniqueMiddleware(backend=RedisBackend(url=url), prefix=namespace, reschedule_delay=100)
    LockMetrics(middleware)
    broker.add_middleware(middleware)
    flags = redis.Redis.from_url(url)

    @dramatiq.actor(broker=broker, queue_name=namespace, actor_name="hold", lock="while_executing")
    def hold(account_id: int) -> None:
        while not flags.exists(f"{namespace}:go"):
            time.sleep(0.02)

    dramatiq.set_broker(broker)


def test_dramatiq_exposition_sums_every_worker_process(monkeypatch, tmp_path, redis_url, redis_client):
    # Given two worker processes with Dramatiq's Prometheus middleware and ours
    namespace, port = f"prom-{uuid.uuid4().hex[:8]}", free_port()
    env = {"PROM_NAMESPACE": namespace, "PROM_REDIS_URL": redis_url, "dramatiq_prom_db": str(tmp_path),
           "dramatiq_prom_host": "127.0.0.1", "dramatiq_prom_port": str(port)}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    worker_broker()
    hold: Any = dramatiq.get_broker().get_actor("hold")
    url = f"http://127.0.0.1:{port}/metrics"

    def scraped() -> str:
        try:
            return scrape(url)
        except OSError:
            return ""

    with WorkerGroup("tests.test_prometheus:worker_broker", processes=2, threads=2, env=env) as workers:
        workers.wait_booted(2)
        # When two keys are held and a third delivery waits for one of them
        for account in (1, 1, 2):
            hold.send(account)
        wait_for(lambda: total(scraped(), LEASES, actor_name="hold") == 2, timeout=30, what="two leases held")
        redis_client.set(f"{namespace}:go", 1)
        wait_for(lambda: total(scraped(), EVENTS, actor_name="hold", event="released") == 3, timeout=30,
                 what="three releases")
        # Then Dramatiq's exposition carries our series, summed over processes, beside its own
        text = scraped()
        assert total(text, LEASES, actor_name="hold") == 0
        assert total(text, EVENTS, actor_name="hold", event="locked") == 3
        assert total(text, EVENTS, actor_name="hold", event="rescheduled") >= 1
        assert named(text, "dramatiq_messages_total")
        assert workers.stop() == 0
    dramatiq.get_broker().close()
