"""A contended workload under Dramatiq's own ``Prometheus`` middleware,
for real ``dramatiq`` workers (``tests.apps.contended:broker``).

Configured by environment variables, so the test process (which only
sends) and the worker processes build the same queues:

* ``CONTENDED_REDIS_URL``: the Redis of the broker, the locks and the
  record of runs.
* ``CONTENDED_NAMESPACE``: isolates keys and the queue of one run.
* ``CONTENDED_ORDER``: ``prometheus_first`` or ``unique_first``, the
  order of the two ``add_middleware`` calls.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Mapping, Optional

import dramatiq
import redis
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware import default_middleware

from dramatiq_unique import UniqueMiddleware
from dramatiq_unique.backends.redis import RedisBackend
from dramatiq_unique.compat import Prometheus

#: How long one run holds its account, in seconds.
RUN_SECONDS = 0.25


def build(env: Optional[Mapping[str, str]] = None, *, metrics: bool = True) -> tuple[dramatiq.Broker, Any, Any]:
    """The broker and its two actors: ``hold`` (a run lock per account,
    rescheduled on conflict) and ``stale`` (no lock; sent with a
    ``max_age`` it has outlived, so AgeLimit skips it).
    """
    env = os.environ if env is None else env
    namespace, url = env["CONTENDED_NAMESPACE"], env["CONTENDED_REDIS_URL"]
    # Without the default Prometheus of Dramatiq 1.x: the order is the test's.
    stack = [m() for m in default_middleware if m is not Prometheus]
    broker = RedisBroker(url=url, namespace=namespace, middleware=stack)
    unique = UniqueMiddleware(backend=RedisBackend(url=url), prefix=namespace, reschedule_delay=100)
    if metrics:
        from dramatiq_unique.ops.prometheus import LockMetrics

        LockMetrics(unique)
        added = [Prometheus(), unique]
        broker_order = env.get("CONTENDED_ORDER", "prometheus_first")
        for middleware in added if broker_order == "prometheus_first" else reversed(added):
            broker.add_middleware(middleware)
    else:
        broker.add_middleware(unique)
    record = redis.Redis.from_url(url)

    @dramatiq.actor(broker=broker, queue_name=namespace, actor_name="hold", lock="while_executing",
                    on_conflict="reschedule", max_retries=0)
    def hold(account_id: int) -> None:
        start = time.time()
        time.sleep(RUN_SECONDS)
        record.rpush(f"{namespace}:runs", json.dumps({"account": account_id, "start": start, "end": time.time()}))

    @dramatiq.actor(broker=broker, queue_name=namespace, actor_name="stale", max_retries=0)
    def stale() -> None:
        record.rpush(f"{namespace}:stale-ran", 1)

    return broker, hold, stale


if "CONTENDED_NAMESPACE" in os.environ:
    broker, hold, stale = build()
    dramatiq.set_broker(broker)
