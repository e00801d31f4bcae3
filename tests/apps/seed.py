"""The seed scenario's broker module, for real ``dramatiq`` workers.

Configured by environment variables so the test process and the worker
processes build the same thing:

* ``SEED_BROKER``: ``redis`` or ``rabbitmq``.
* ``SEED_REDIS_URL``: the Redis for locks, runs and the Redis broker.
* ``SEED_RABBITMQ_URL``: the RabbitMQ broker's URL.
* ``SEED_NAMESPACE``: isolates keys and queues of one test.
* ``SEED_SECONDS``: how long one sync takes.
* ``SEED_LOCKS_URL``: when set, a PostgreSQL URL for the locks instead
  of Redis.
"""

from __future__ import annotations

import json
import os
import time

import dramatiq
import redis

from dramatiq_unique import UniqueMiddleware
from dramatiq_unique.backends.base import LockBackend
from dramatiq_unique.backends.redis import RedisBackend


def locks(redis_url: str) -> LockBackend:
    """The lock backend: PostgreSQL at ``SEED_LOCKS_URL`` when set, else Redis."""
    if os.environ.get("SEED_LOCKS_URL"):
        from dramatiq_unique.backends.postgres import PostgresBackend

        return PostgresBackend(url=os.environ["SEED_LOCKS_URL"])
    return RedisBackend(url=redis_url)


def build() -> tuple[dramatiq.Broker, dramatiq.Actor]:
    namespace = os.environ["SEED_NAMESPACE"]
    redis_url = os.environ["SEED_REDIS_URL"]
    if os.environ.get("SEED_BROKER", "redis") == "rabbitmq":
        from dramatiq.brokers.rabbitmq import RabbitmqBroker

        broker: dramatiq.Broker = RabbitmqBroker(url=os.environ["SEED_RABBITMQ_URL"])
    else:
        from dramatiq.brokers.redis import RedisBroker

        broker = RedisBroker(url=redis_url, namespace=namespace)
    broker.add_middleware(UniqueMiddleware(backend=locks(redis_url), prefix=namespace, reschedule_delay=300))
    record = redis.Redis.from_url(redis_url)
    seconds = float(os.environ.get("SEED_SECONDS", "0.2"))

    @dramatiq.actor(
        broker=broker,
        queue_name=namespace,
        lock="while_executing",
        on_conflict="reschedule",
        lock_args=["account_id"],
    )
    def sync_account_balance(account_id: int, requested_at: float) -> None:
        start = time.time()
        time.sleep(seconds)
        message = dramatiq.middleware.CurrentMessage.get_current_message()
        run = {"account": account_id, "start": start, "end": time.time(), "pid": os.getpid(),
               "message_id": message.message_id if message else None}
        record.rpush(f"{namespace}:runs", json.dumps(run))

    return broker, sync_account_balance


broker, sync_account_balance = build()
broker.add_middleware(dramatiq.middleware.CurrentMessage())
