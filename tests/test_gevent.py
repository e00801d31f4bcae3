"""Real ``dramatiq-gevent`` worker processes: the seed scenario, crash
recovery, a holder that blocks the hub for longer than its lease, and
the background tasks that stay greenlets there (the releaser, the
confirmer, the retries of failed releases).

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
from collections import Counter
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlsplit, urlunsplit

import pika  # type: ignore[import-untyped]
import pytest
import redis

from dramatiq_unique.ops.admin import LockAdmin
from dramatiq_unique.backends.redis import RedisBackend
from tests import test_seed_scenario
from tests.conftest import wait_for
from tests.faults import harness as faults_harness
from tests.faults import test_crash
from tests.faults.conftest import figure, make_harness  # noqa: F401 - fixtures of the fault harness
from tests.faults.harness import Harness, delete_queues, overlaps, peak
from tests.faults.proxy import through
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
    parts = urlsplit(rabbitmq_url)  # RABBITMQ_URL's server and user, on this module's own virtual host
    url, user = urlunsplit(parts._replace(path=f"/{VHOST}")), parts.username or "guest"
    if not _reachable(url) and shutil.which("rabbitmqctl"):
        for command in (["add_vhost", VHOST], ["set_permissions", "-p", VHOST, user, ".*", ".*", ".*"]):
            subprocess.run(["rabbitmqctl", *command], capture_output=True, timeout=60)
    if not _reachable(url):
        pytest.fail(f"RabbitMQ has no virtual host {VHOST} for {user}: run `rabbitmqctl add_vhost {VHOST}` and "
                    f"`rabbitmqctl set_permissions -p {VHOST} {user} '.*' '.*' '.*'`.")
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


def test_seed_scenario_under_gevent_with_locks_in_postgres(gevent_workers, monkeypatch, redis_url, redis_client,
                                                           postgres_url):
    test_seed_scenario.check(*test_seed_scenario.scenario(monkeypatch, redis_url, redis_client, "redis",
                                                          locks_url=postgres_url))


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


# (d) The background tasks that stay greenlets ---------------------------------------

#: The burst: this many keys, this many jobs of each.
BURST_KEYS, BURST_PER_KEY = 3, 20

#: A lease long enough that a release left undone would hold its key
#: well past the test's bound: only a release frees it in time.
LONG_LEASE_MS = 30_000


def _held(admin: LockAdmin, actor: str, phase: str) -> int:
    return sum(1 for lock in admin.locks(actor=actor, phase=phase) if lock.holders)


def test_under_gevent_background_releases_free_every_key_of_a_burst(gevent_workers, make_harness,  # noqa: F811
                                                                    redis_url, figure):  # noqa: F811
    # Given two dramatiq-gevent processes whose run locks are released in the background (the releaser)
    h: Harness = make_harness("redis", FAULTS_LEASE=str(LONG_LEASE_MS), FAULTS_RESCHEDULE_DELAY="100")
    assert h.app.unique.threads.releaser is not None, "the Redis backend batches releases: they go through the releaser"
    h.workers(processes=2, threads=4)
    admin = LockAdmin(RedisBackend(url=redis_url), prefix=h.namespace)
    # When a burst of while_executing jobs on a few keys is sent at once
    began = time.monotonic()
    sent = [h.app.hold.send(f"k{n % BURST_KEYS}", seconds=0.01) for n in range(BURST_KEYS * BURST_PER_KEY)]
    wait_for(lambda: len(h.runs()) >= len(sent) and h.queued() == 0, timeout=120, what="every job to run")
    drained = time.monotonic() - began
    runs = h.runs()
    last_end = max(run.end or 0 for run in runs)
    wait_for(lambda: _held(admin, "hold", "run") == 0, timeout=10, what="every key to be free")
    freed_after = time.time() - last_end
    # Then each job ran once, no two runs of a key overlapped, and every key was free soon after the last run
    per_message = Counter(run.message_id for run in runs)
    figure("runs", len(runs))
    figure("overlaps", len(overlaps(runs)))
    figure("all_ran_after_s", round(drained, 2))
    figure("keys_free_after_last_run_s", round(freed_after, 3))
    print(f"{len(runs)} runs in {drained:.2f} s, {len(overlaps(runs))} overlaps, keys free {freed_after:.3f} s "
          f"after the last run")
    assert per_message == Counter({message.message_id: 1 for message in sent}), per_message
    assert not overlaps(runs) and peak(runs) == 1
    assert freed_after < 2.0, "a run lock outlived its run: its release waited for the lease"


#: How many sends the gevent worker's actor makes, and their window.
SENDS, WINDOW_MS = 50, 1_000


def test_under_gevent_the_confirmer_confirms_a_workers_sends_on_rabbitmq(redis_url, redis_client, vhost_url,
                                                                         monkeypatch, figure):  # noqa: F811
    # Given a dramatiq-gevent worker on RabbitMQ whose actor sends until_executed jobs, delayed so none runs
    _dramatiq_gevent()
    namespace = f"gevent-{uuid.uuid4().hex[:8]}"
    env = {"GEVENT_BROKER": "rabbitmq", "GEVENT_REDIS_URL": redis_url, "GEVENT_RABBITMQ_URL": vhost_url,
           "GEVENT_NAMESPACE": namespace, "GEVENT_PROVISIONAL_WINDOW": str(WINDOW_MS)}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    from tests.apps import gevent_sender

    broker, fan_out = gevent_sender.build()
    admin = LockAdmin(RedisBackend(url=redis_url), prefix=namespace)
    try:
        with GeventWorkers("tests.apps.gevent_sender:broker", processes=1, threads=2,
                           env={**env, "dramatiq_worker_timeout": "100"}) as workers:
            workers.wait_booted(1, timeout=60)
            # When the actor sends them, each send taking its lock for the provisional window only
            fan_out.send(SENDS, 600_000)
            wait_for(lambda: redis_client.llen(f"{namespace}:sent"), timeout=30, what="the sends")
            sent_at = json.loads(redis_client.lindex(f"{namespace}:sent", 0))["at"]
            # Then the worker's confirmer gives every lock its full lifetime, well within the window
            wait_for(lambda: _confirmed(admin) == SENDS, timeout=WINDOW_MS / 1000, what="every lock to be confirmed")
            confirmed_after = time.time() - sent_at
            # And past the window every lock is still held: none lapsed
            time.sleep(max(0.0, sent_at + 2 * WINDOW_MS / 1000 - time.time()))
            still_held = _held(admin, "child", "queue")
            assert workers.stop() == 0
    finally:
        broker.close()
        delete_queues(vhost_url, namespace)
    figure("sends", SENDS)
    figure("confirmed_after_s", round(confirmed_after, 3))
    figure("held_after_twice_the_window", still_held)
    print(f"{SENDS} sends confirmed {confirmed_after:.3f} s after the last, {still_held} held after "
          f"{2 * WINDOW_MS} ms")
    assert still_held == SENDS


def _confirmed(admin: LockAdmin) -> int:
    return sum(1 for lock in admin.locks(actor="child", phase="queue") for h in lock.holders if not h.provisional)


#: How long the network to the lock Redis stays cut after the release failed.
CUT_S = 2.0


def test_under_gevent_a_release_that_failed_is_retried_until_the_network_is_back(  # noqa: F811
    gevent_workers, make_harness, proxy, redis_url, figure  # noqa: F811
):
    # Given a dramatiq-gevent worker that reaches the lock Redis through a proxy, running an until_executed job
    h: Harness = make_harness("redis", FAULTS_LOCK_URL=through(proxy, redis_url))
    h.workers(processes=1, threads=2)
    admin = LockAdmin(RedisBackend(url=redis_url), prefix=h.namespace)
    first = h.app.once.send("k", gate="run")
    h.started(first.message_id)
    # When the network drops as the job succeeds, so that its release fails, and stays down a while
    proxy.cut()
    h.open_gate("run")
    wait_for(lambda: h.events("backend_error"), timeout=30, what="the release to fail")
    time.sleep(CUT_S)  # the outage: every retry meanwhile fails too
    held_while_cut = _held(admin, "once", "queue")
    proxy.heal()
    healed = time.monotonic()
    # Then FailedReleases, a greenlet there, frees the key soon after the network is back
    wait_for(lambda: _held(admin, "once", "queue") == 0, timeout=10, what="the key to be freed")
    freed_after = time.monotonic() - healed
    # And a new send of the key is accepted and runs
    again = h.app.once.send("k")
    assert "unique_duplicate_of" not in again.options
    assert h.finished(again.message_id).key == "k"
    per_message = Counter(run.message_id for run in h.runs())
    figure("outage_s", CUT_S)
    figure("key_free_after_heal_s", round(freed_after, 3))
    figure("failed_releases_reported", len(h.events("backend_error")))
    print(f"outage {CUT_S} s, key free {freed_after:.3f} s after the network came back")
    assert held_while_cut == 1
    assert per_message == Counter({first.message_id: 1, again.message_id: 1}), per_message
    assert freed_after < 2.0, "the failed release was not retried within its 1 s backoff"
