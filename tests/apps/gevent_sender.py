"""A broker module for ``dramatiq-gevent`` workers whose actor sends:
each send takes a provisional enqueue lock, which the worker process's
confirmer (a greenlet there) must confirm before the window runs out.

Configured by environment variables, so the test process and the
worker processes build the same thing:

* ``GEVENT_BROKER``: ``redis`` or ``rabbitmq``.
* ``GEVENT_REDIS_URL``: the Redis for locks, records and the Redis broker.
* ``GEVENT_RABBITMQ_URL``: the RabbitMQ broker's URL.
* ``GEVENT_NAMESPACE``: isolates keys, queues and records of one test.
* ``GEVENT_PROVISIONAL_WINDOW``: the provisional window, in milliseconds.

``fan_out(count, delay)`` sends ``count`` messages of the
``until_executed`` actor ``child`` (keys ``k0``, ``k1``, ...) with
``delay`` ms, then appends JSON to ``<ns>:sent`` (time, pid).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import dramatiq
import redis

from dramatiq_unique import UniqueMiddleware
from dramatiq_unique.backends.redis import RedisBackend


def make_broker() -> dramatiq.Broker:
    # gevent_holder's own, not imported: that module builds its broker at import.
    if os.environ.get("GEVENT_BROKER", "redis") == "rabbitmq":
        from dramatiq.brokers.rabbitmq import RabbitmqBroker

        return RabbitmqBroker(url=os.environ["GEVENT_RABBITMQ_URL"])
    from dramatiq.brokers.redis import RedisBroker

    return RedisBroker(url=os.environ["GEVENT_REDIS_URL"], namespace=os.environ["GEVENT_NAMESPACE"])


def build() -> tuple[dramatiq.Broker, dramatiq.Actor]:
    namespace = os.environ["GEVENT_NAMESPACE"]
    redis_url = os.environ["GEVENT_REDIS_URL"]
    broker = make_broker()
    broker.add_middleware(UniqueMiddleware(backend=RedisBackend(url=redis_url), prefix=namespace,
                                           provisional_window=int(os.environ["GEVENT_PROVISIONAL_WINDOW"])))
    records = redis.Redis.from_url(redis_url)

    @dramatiq.actor(broker=broker, queue_name=namespace, lock="until_executed", lock_args=["key"], max_retries=0)
    def child(key: str) -> None:
        pass

    @dramatiq.actor(broker=broker, queue_name=namespace, max_retries=0)
    def fan_out(count: int, delay: int) -> None:
        for n in range(count):
            child.send_with_options(args=(f"k{n}",), delay=delay)
        records.rpush(f"{namespace}:sent", json.dumps({"at": time.time(), "pid": os.getpid()}))

    return broker, fan_out


def __getattr__(name: str) -> Any:
    # Built on first use, so the test process can import build() with
    # its own environment; the dramatiq CLI asks for ``broker``.
    if name != "broker":
        raise AttributeError(name)
    broker, _ = build()
    globals()["broker"] = broker
    return broker
