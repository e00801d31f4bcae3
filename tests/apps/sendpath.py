"""The send fast path's broker module, for real ``dramatiq`` workers.

Configured by environment variables, so the test and its workers build
the same thing:

* ``SENDPATH_REDIS_URL``: the Redis of the broker and the locks.
* ``SENDPATH_NAMESPACE``: isolates keys and queues of one test.

Each run of ``job`` records its message, as the worker got it, on the
list ``<namespace>:runs``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import dramatiq
import redis
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware import CurrentMessage

from dramatiq_unique import UniqueMiddleware


class LaterHook(dramatiq.Middleware):
    """A middleware after ours with its own ``before_enqueue``: the send
    fast path stands aside for it.
    """

    def before_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
        pass


def build(url: str, namespace: str, *, two_step: bool = False) -> tuple[RedisBroker, dramatiq.Actor]:
    """A Redis broker with the middleware, and its ``job`` actor;
    ``two_step`` adds a later ``before_enqueue``, so every send takes its
    lock in two round trips.
    """
    broker = RedisBroker(url=url, namespace=namespace)
    broker.add_middleware(CurrentMessage())
    broker.add_middleware(UniqueMiddleware(prefix=namespace))
    if two_step:
        broker.add_middleware(LaterHook())
    records = redis.Redis.from_url(url)

    def job(key: str) -> None:
        message = CurrentMessage.get_current_message()
        assert message is not None
        records.rpush(f"{namespace}:runs", json.dumps(message.asdict()))

    return broker, dramatiq.actor(job, broker=broker, lock="until_executed", lock_args=["key"], max_retries=0)


if "SENDPATH_NAMESPACE" in os.environ:
    broker, job = build(os.environ["SENDPATH_REDIS_URL"], os.environ["SENDPATH_NAMESPACE"])
