"""The broker module of the replace and debounce tests, for real
``dramatiq`` workers.

Configured by environment variables, so that the test process and the
worker processes build the same thing:

* ``NEWEST_BROKER``: ``redis`` or ``rabbitmq``.
* ``NEWEST_REDIS_URL``: the Redis for locks, runs and the Redis broker.
* ``NEWEST_RABBITMQ_URL``: the RabbitMQ broker's URL.
* ``NEWEST_NAMESPACE``: isolates keys and queues of one test module.

Every run is recorded as JSON on the list ``<namespace>:runs``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Mapping

import dramatiq
import redis
from dramatiq.middleware import CurrentMessage

from dramatiq_unique import UniqueMiddleware
from dramatiq_unique.backends.redis import RedisBackend

#: How long one run of each actor takes, in seconds.
RUN_SECONDS = 0.3

#: The retry delay of ``flaky``, in milliseconds.
RETRY_DELAY = 1500


def build(env: Mapping[str, str]) -> tuple[dramatiq.Broker, dict[str, Any]]:
    namespace, redis_url = env["NEWEST_NAMESPACE"], env["NEWEST_REDIS_URL"]
    if env.get("NEWEST_BROKER", "redis") == "rabbitmq":
        from dramatiq.brokers.rabbitmq import RabbitmqBroker

        broker: dramatiq.Broker = RabbitmqBroker(url=env["NEWEST_RABBITMQ_URL"])
    else:
        from dramatiq.brokers.redis import RedisBroker

        broker = RedisBroker(url=redis_url, namespace=namespace)
    broker.add_middleware(CurrentMessage())
    broker.add_middleware(UniqueMiddleware(backend=RedisBackend(url=redis_url), prefix=namespace, reschedule_delay=200))
    record = redis.Redis.from_url(redis_url)

    def run(actor: str, key: str, n: int) -> None:
        start = time.time()
        message = CurrentMessage.get_current_message()
        time.sleep(RUN_SECONDS)
        entry = {"actor": actor, "key": key, "n": n, "start": start, "end": time.time(), "pid": os.getpid(),
                 "message_id": message.message_id if message else None}
        record.rpush(f"{namespace}:runs", json.dumps(entry))

    @dramatiq.actor(broker=broker, queue_name=f"{namespace}-burst", debounce=500, lock_args=["key"])
    def burst(key: str, n: int) -> None:
        run("burst", key, n)

    @dramatiq.actor(broker=broker, queue_name=f"{namespace}-starve", lock="until_and_while_executing",
                    debounce=500, debounce_max=2000, lock_args=["key"])
    def starve(key: str, n: int) -> None:
        run("starve", key, n)

    @dramatiq.actor(broker=broker, queue_name=f"{namespace}-flaky", lock="until_executed", on_conflict="replace",
                    lock_args=["key"], max_retries=3, min_backoff=RETRY_DELAY, max_backoff=RETRY_DELAY)
    def flaky(key: str, n: int, fail: bool) -> None:
        run("flaky", key, n)
        if fail:
            raise RuntimeError(f"run {n} fails")

    return broker, {"burst": burst, "starve": starve, "flaky": flaky}


if os.environ.get("NEWEST_NAMESPACE"):  # the workers; tests call build() themselves
    broker, actors = build(os.environ)
