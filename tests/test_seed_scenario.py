"""The seed scenario, serialize per resource, with real ``dramatiq``
worker processes (2 processes x 4 threads).
"""

from __future__ import annotations

import json
import time
import uuid


from tests.conftest import wait_for
from tests.procs import WorkerGroup

SENDS = [42] * 6 + [43, 44, 45, 46]


def scenario(monkeypatch, redis_url, redis_client, broker_kind, rabbitmq_url=None, locks_url=None):
    namespace = f"seed-{uuid.uuid4().hex[:8]}"
    env = {"SEED_BROKER": broker_kind, "SEED_REDIS_URL": redis_url, "SEED_NAMESPACE": namespace,
           "SEED_SECONDS": "0.3", "SEED_RABBITMQ_URL": rabbitmq_url or "", "SEED_LOCKS_URL": locks_url or ""}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    from tests.apps import seed

    broker, actor = seed.build()
    # Both processes take part: each prefetches 2 jobs at most, and the jobs are sent once both consume
    # (a process that boots first would otherwise prefetch every one).
    worker_env = {**env, "dramatiq_queue_prefetch": "2"}
    with WorkerGroup("tests.apps.seed:broker", processes=2, threads=4, env=worker_env) as workers:
        workers.wait_booted(2)
        sent = [actor.send(account, time.time()).message_id for account in SENDS]
        wait_for(lambda: redis_client.llen(f"{namespace}:runs") >= len(SENDS), timeout=60,
                 what=f"{len(SENDS)} runs")
        time.sleep(1.0)  # rescheduled copies still in flight must not run again: the behaviour under test
        assert workers.stop() == 0
    if broker_kind == "rabbitmq":
        broker.channel.queue_delete(namespace)
        broker.channel.queue_delete(f"{namespace}.DQ")
        broker.channel.queue_delete(f"{namespace}.XQ")
    broker.close()
    runs = [json.loads(raw) for raw in redis_client.lrange(f"{namespace}:runs", 0, -1)]
    return sent, runs


def check(sent, runs):
    # every sent message ran exactly once
    assert sorted(r["message_id"] for r in runs) == sorted(sent)
    # no two runs for one account overlap
    for account in set(SENDS):
        spans = sorted((r["start"], r["end"]) for r in runs if r["account"] == account)
        assert all(b[0] >= a[1] for a, b in zip(spans, spans[1:])), f"runs for {account} overlapped: {spans}"
    # different accounts did run at the same time as 42
    first42 = min((r for r in runs if r["account"] == 42), key=lambda r: r["start"])
    assert any(r["start"] < first42["end"] and r["end"] > first42["start"] for r in runs if r["account"] != 42)
    # and both worker processes took part
    assert len({r["pid"] for r in runs}) == 2


def test_seed_scenario_on_redis(monkeypatch, redis_url, redis_client):
    check(*scenario(monkeypatch, redis_url, redis_client, "redis"))


def test_seed_scenario_on_rabbitmq(monkeypatch, redis_url, redis_client, rabbitmq_url):
    check(*scenario(monkeypatch, redis_url, redis_client, "rabbitmq", rabbitmq_url))


def test_seed_scenario_with_locks_in_postgres_on_redis(monkeypatch, redis_url, redis_client, postgres_url):
    check(*scenario(monkeypatch, redis_url, redis_client, "redis", locks_url=postgres_url))


def test_seed_scenario_with_locks_in_postgres_on_rabbitmq(monkeypatch, redis_url, redis_client, rabbitmq_url,
                                                         postgres_url):
    check(*scenario(monkeypatch, redis_url, redis_client, "rabbitmq", rabbitmq_url, locks_url=postgres_url))
