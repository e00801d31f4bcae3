"""Real ``dramatiq-gevent`` worker processes: the seed scenario, crash
recovery, and a holder that blocks the hub for longer than its lease.

Under gevent's monkey-patching every thread of a worker is a greenlet
on one OS thread; an actor in a C call (a C database driver) or a CPU
loop holds that thread, and no greenlet runs until it returns.  The
lease keeper runs on a native OS thread there, with a connection of its
own, so that the lease of such an actor is still renewed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pika  # type: ignore[import-untyped]
import pytest
import redis

from tests import test_seed_scenario
from tests.conftest import wait_for
from tests.faults import harness as faults_harness
from tests.faults import test_crash
from tests.faults.conftest import figure, make_harness  # noqa: F401 - fixtures of the crash case
from tests.faults.harness import delete_queues
from tests.procs import WorkerGroup

#: The RabbitMQ virtual host of these tests, so that their queues never
#: meet another test's.
VHOST = "dramatiq_unique_gevent"

LEASE_MS = 2_000

#: How long the holder blocks the hub: well past its lease.
BLOCK_S = 5.0


def _dramatiq_gevent() -> str:
    try:
        import gevent  # noqa: F401
    except ImportError:
        pytest.fail("gevent is not installed: run `pip install -e '.[test]'` (or `pip install gevent`).")
    script = shutil.which("dramatiq-gevent", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.fail("dramatiq-gevent (a console script of dramatiq) is missing: reinstall dramatiq in this venv.")
    return script


class GeventWorkers(WorkerGroup):
    """A :class:`~tests.procs.WorkerGroup` run by ``dramatiq-gevent``."""

    def __init__(self, module: str, **options: Any) -> None:
        super().__init__(module, **options)
        self.args[0:3] = [sys.executable, _dramatiq_gevent()]


@pytest.fixture
def gevent_workers(monkeypatch: pytest.MonkeyPatch) -> type[GeventWorkers]:
    """Make the seed scenario and the fault harness start gevent workers."""
    _dramatiq_gevent()
    monkeypatch.setattr(test_seed_scenario, "WorkerGroup", GeventWorkers)
    monkeypatch.setattr(faults_harness, "WorkerGroup", GeventWorkers)
    return GeventWorkers


@pytest.fixture
def vhost_url(rabbitmq_url: str) -> str:
    """The URL of this module's own RabbitMQ virtual host, made when
    ``rabbitmqctl`` can make it; fails with how to make it otherwise.
    """
    url = f"{rabbitmq_url.rstrip('/')}/{VHOST}"
    if not _reachable(url) and shutil.which("rabbitmqctl"):
        for command in (["add_vhost", VHOST], ["set_permissions", "-p", VHOST, "guest", ".*", ".*", ".*"]):
            subprocess.run(["rabbitmqctl", *command], capture_output=True, timeout=60)
    if not _reachable(url):
        pytest.fail(f"RabbitMQ has no virtual host {VHOST} for guest: run `rabbitmqctl add_vhost {VHOST}` and "
                    f"`rabbitmqctl set_permissions -p {VHOST} guest '.*' '.*' '.*'`.")
    return url


def _reachable(url: str) -> bool:
    try:
        pika.BlockingConnection(pika.URLParameters(url)).close()
    except pika.exceptions.AMQPError:
        return False
    return True


# (a) The seed scenario ----------------------------------------------------------


def test_seed_scenario_under_gevent_on_redis(gevent_workers, monkeypatch, redis_url, redis_client):
    test_seed_scenario.check(*test_seed_scenario.scenario(monkeypatch, redis_url, redis_client, "redis"))


def test_seed_scenario_under_gevent_on_rabbitmq(gevent_workers, monkeypatch, redis_url, redis_client, vhost_url):
    test_seed_scenario.check(*test_seed_scenario.scenario(monkeypatch, redis_url, redis_client, "rabbitmq",
                                                          vhost_url))


# (b) Crash recovery -----------------------------------------------------------------


def test_a_killed_gevent_holder_frees_its_key_within_one_lease(gevent_workers, make_harness, figure):  # noqa: F811
    test_crash.test_a_killed_while_executing_holder_frees_its_key_within_one_lease(make_harness, figure, "redis")


# (c) A holder that blocks the hub -------------------------------------------------------


@pytest.fixture
def holder_env(request: pytest.FixtureRequest, redis_url: str, redis_client: redis.Redis) -> Iterator[dict[str, str]]:
    broker = request.param
    env = {"GEVENT_BROKER": broker, "GEVENT_REDIS_URL": redis_url, "GEVENT_LEASE": str(LEASE_MS),
           "GEVENT_NAMESPACE": f"gevent-{uuid.uuid4().hex[:8]}"}
    if broker == "rabbitmq":
        env["GEVENT_RABBITMQ_URL"] = request.getfixturevalue("vhost_url")
    yield env
    if broker == "rabbitmq":
        delete_queues(env["GEVENT_RABBITMQ_URL"], env["GEVENT_NAMESPACE"])


def _records(client: redis.Redis, namespace: str, name: str) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in client.lrange(f"{namespace}:{name}", 0, -1)]


def _deadlines(client: redis.Redis, namespace: str) -> dict[str, int]:
    """The run lock slots of ``namespace``: owner -> deadline (server ms)."""
    slots: dict[str, int] = {}
    for key in client.scan_iter(match=f"{namespace}:*:run"):
        for field, value in client.hgetall(key).items():
            if not field.startswith(b"!"):
                slots[field.decode()] = int(value)
    return slots


@pytest.mark.parametrize("holder_env", ["redis", "rabbitmq"], indirect=True)
def test_a_holder_that_blocks_the_hub_keeps_its_lease(holder_env, redis_client, monkeypatch, figure):  # noqa: F811
    # Given two dramatiq-gevent worker processes, each fetching one message at a time
    for name, value in holder_env.items():
        monkeypatch.setenv(name, value)
    from tests.apps import gevent_holder

    broker, hold = gevent_holder.build()
    namespace = holder_env["GEVENT_NAMESPACE"]
    env = {**holder_env, "dramatiq_queue_prefetch": "1", "dramatiq_worker_timeout": "100"}
    try:
        with GeventWorkers("tests.apps.gevent_holder:broker", processes=2, threads=2, env=env) as workers:
            workers.wait_booted(2, timeout=60)
            # When a holder of k blocks its hub in a C call for longer than its lease
            holder = hold.send("k", BLOCK_S, "c")
            wait_for(lambda: _records(redis_client, namespace, "starts"), timeout=30, what="the holder to start")
            # And the other process is sent a job for the same key
            contender = hold.send("k", 0.1)
            renewals = _watch_renewals(redis_client, namespace)
            wait_for(lambda: len(_records(redis_client, namespace, "runs")) == 2, timeout=30,
                     what="both jobs to finish")
            assert workers.stop() == 0
    finally:
        broker.close()
    runs = {run["message_id"]: run for run in _records(redis_client, namespace, "runs")}
    # Then the two runs of k never overlapped: the contender ran after the holder
    assert runs[contender.message_id]["start"] >= runs[holder.message_id]["end"], runs
    # And each job ran once
    assert sorted(run["message_id"] for run in _records(redis_client, namespace, "starts")) == sorted(runs)
    # And the lease was renewed while the hub was blocked, every lease/3 or so
    intervals = [round(b - a, 3) for a, b in zip(renewals, renewals[1:])]
    blocked = runs[holder.message_id]["end"] - runs[holder.message_id]["start"]
    figure("blocked_s", round(blocked, 2))
    figure("lease_ms", LEASE_MS)
    figure("renewal_intervals_s", intervals)
    print(f"blocked {blocked:.2f} s, lease {LEASE_MS} ms, renewals every {intervals} s")
    assert blocked >= BLOCK_S
    assert len(renewals) >= 4 and max(intervals) < LEASE_MS / 1000 / 2, renewals


def _watch_renewals(client: redis.Redis, namespace: str) -> list[float]:
    """Until the first run ends, the times (test clock, s) at which the
    holder's deadline moved: each one is a renewal that reached Redis.
    """
    seen: dict[str, int] = {}
    moved: list[float] = []
    while not _records(client, namespace, "runs"):
        for owner, deadline in _deadlines(client, namespace).items():
            if owner in seen and deadline != seen[owner]:
                moved.append(time.time())
            seen[owner] = deadline
        time.sleep(0.02)
    return moved
