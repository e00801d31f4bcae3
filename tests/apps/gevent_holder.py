"""A broker module for ``dramatiq-gevent`` workers whose actor can hold
the hub: it blocks in a call that never yields to gevent.

Configured by environment variables, so the test process and the
worker processes build the same thing:

* ``GEVENT_BROKER``: ``redis`` or ``rabbitmq``.
* ``GEVENT_REDIS_URL``: the Redis for locks, records and the Redis broker.
* ``GEVENT_RABBITMQ_URL``: the RabbitMQ broker's URL.
* ``GEVENT_NAMESPACE``: isolates keys, queues and records of one test.
* ``GEVENT_LEASE``: the run lease, in milliseconds.

``hold(key, seconds, block)`` appends JSON to ``<ns>:starts`` when it
begins and to ``<ns>:runs`` when it ends (start, end, pid, message id).
In between it sleeps ``seconds``: with ``block="c"`` in libc's
``usleep`` (a C call, as a C database driver makes), with ``"cpu"`` in
a busy loop, else in gevent's patched ``time.sleep``, which yields.
"""

from __future__ import annotations

import ctypes
import json
import os
import time

import dramatiq
import redis
from dramatiq.middleware import CurrentMessage

from dramatiq_unique import UniqueMiddleware
from dramatiq_unique.backends.redis import RedisBackend


def make_broker() -> dramatiq.Broker:
    if os.environ.get("GEVENT_BROKER", "redis") == "rabbitmq":
        from dramatiq.brokers.rabbitmq import RabbitmqBroker

        return RabbitmqBroker(url=os.environ["GEVENT_RABBITMQ_URL"])
    from dramatiq.brokers.redis import RedisBroker

    return RedisBroker(url=os.environ["GEVENT_REDIS_URL"], namespace=os.environ["GEVENT_NAMESPACE"])


def block(how: str, seconds: float) -> None:
    """Sleep ``seconds`` without yielding to gevent (``c``, ``cpu``), or
    yielding (anything else).
    """
    if how == "c":
        ctypes.CDLL(None).usleep(int(seconds * 1_000_000))
    elif how == "cpu":
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            pass
    else:
        time.sleep(seconds)


def build() -> tuple[dramatiq.Broker, dramatiq.Actor]:
    namespace = os.environ["GEVENT_NAMESPACE"]
    redis_url = os.environ["GEVENT_REDIS_URL"]
    broker = make_broker()
    broker.add_middleware(UniqueMiddleware(backend=RedisBackend(url=redis_url), prefix=namespace,
                                           lease=int(os.environ.get("GEVENT_LEASE", "2000")), reschedule_delay=200))
    broker.add_middleware(CurrentMessage())
    records = redis.Redis.from_url(redis_url)

    @dramatiq.actor(broker=broker, queue_name=namespace, lock="while_executing", on_conflict="reschedule",
                    lock_args=["key"], max_retries=0)
    def hold(key: str, seconds: float, how: str = "sleep") -> None:
        message = CurrentMessage.get_current_message()
        run = {"key": key, "message_id": message.message_id if message else "", "pid": os.getpid(),
               "start": time.time()}
        records.rpush(f"{namespace}:starts", json.dumps(run))
        block(how, seconds)
        run["end"] = time.time()
        records.rpush(f"{namespace}:runs", json.dumps(run))

    return broker, hold


broker, hold = build()
