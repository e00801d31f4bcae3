"""Orphaned enqueue locks: a broker module for real ``dramatiq``
workers and producer processes.

Configured by environment variables, so the test, its producers and its
workers build the same thing:

* ``ORPHANS_BROKER``: ``redis`` or ``rabbitmq``.
* ``ORPHANS_REDIS_URL``: the Redis of the locks, the records and the
  Redis broker.
* ``ORPHANS_RABBITMQ_URL``: the RabbitMQ broker's URL.
* ``ORPHANS_NAMESPACE``: isolates keys and queues of one test.
* ``ORPHANS_RECORD_PASSES``: ``1`` records every reaper pass (start,
  end, pid) and makes each last at least 100 ms.
* ``ORPHANS_TWO_STEP``: ``1`` adds a later middleware with its own
  ``before_enqueue``, so that a Redis broker's sends take their lock in
  one round trip and publish in another, as on RabbitMQ, instead of the
  send fast path's one.
* ``dramatiq_unique_*``: the middleware's settings, as in production.

Run as ``python -m tests.apps.orphans MODE QUEUE KEY``: ``send`` sends
one message and exits normally; ``die`` sends one and dies with
``os._exit(9)`` inside the broker's low-level publish, after the
enqueue lock was taken and before anything was published;
``die-after-publish`` dies after the publish returned, before the lock
was handed to the confirmer (the crash window); ``die-in-send`` dies
after the send fast path's one script went out, before its reply.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import dramatiq
import redis
from dramatiq.middleware import CurrentMessage

from dramatiq_unique import UniqueMiddleware
from dramatiq_unique.backends.redis import RedisBackend

NAMESPACE = os.environ["ORPHANS_NAMESPACE"]
REDIS_URL = os.environ["ORPHANS_REDIS_URL"]
RABBITMQ = os.environ.get("ORPHANS_BROKER", "redis") == "rabbitmq"

if RABBITMQ:
    from dramatiq.brokers.rabbitmq import RabbitmqBroker

    broker: dramatiq.Broker = RabbitmqBroker(url=os.environ["ORPHANS_RABBITMQ_URL"])
else:
    from dramatiq.brokers.redis import RedisBroker

    broker = RedisBroker(url=REDIS_URL, namespace=NAMESPACE)
broker.add_middleware(CurrentMessage())
unique = UniqueMiddleware(backend=RedisBackend(url=REDIS_URL), prefix=NAMESPACE, record_lock_args=True)
broker.add_middleware(unique)
records = redis.Redis.from_url(REDIS_URL)


class LaterHook(dramatiq.Middleware):
    """A later ``before_enqueue``: the send fast path stands aside."""

    def before_enqueue(self, broker: dramatiq.Broker, message: Any, delay: Any) -> None:
        pass


if os.environ.get("ORPHANS_TWO_STEP") == "1":
    broker.add_middleware(LaterHook())


def _body(key: str, gate: str = "") -> None:
    message = CurrentMessage.get_current_message()
    run: dict[str, Any] = {"key": key, "message_id": message.message_id if message else None, "start": time.time()}
    records.rpush(f"{NAMESPACE}:starts", json.dumps(run))
    deadline = time.monotonic() + 60
    while gate and not records.exists(f"{NAMESPACE}:gate:{gate}") and time.monotonic() < deadline:
        time.sleep(0.02)
    run["end"] = time.time()
    records.rpush(f"{NAMESPACE}:runs", json.dumps(run))


def _actor(queue: str) -> dramatiq.Actor:
    # RabbitMQ queues are shared by the machine: namespace them.
    queue_name = f"{NAMESPACE}-{queue}" if RABBITMQ else queue
    return dramatiq.actor(
        _body, actor_name=f"job_{queue}", broker=broker, queue_name=queue_name, lock="until_executed",
        lock_args=["key"], max_retries=0,
    )


#: One actor per queue: ``run`` is consumed by the test's workers; the
#: others are only purged or left queued.
job_run = _actor("run")
job_gone = _actor("gone")
job_kept = _actor("kept")
ACTORS = {"run": job_run, "gone": job_gone, "kept": job_kept}


def _record_passes() -> None:
    from dramatiq_unique.worker import reap

    original = reap.Reaper.run

    def run(self: reap.Reaper, **kwargs: Any) -> reap.ReapReport:
        start = time.time()
        try:
            return original(self, **kwargs)
        finally:
            time.sleep(max(0.0, 0.1 - (time.time() - start)))
            records.rpush(f"{NAMESPACE}:passes", json.dumps({"pid": os.getpid(), "start": start, "end": time.time()}))

    reap.Reaper.run = run  # type: ignore[method-assign]


if os.environ.get("ORPHANS_RECORD_PASSES") == "1":
    _record_passes()


def _die_inside_publish() -> None:
    def die(*args: Any, **kwargs: Any) -> None:
        os._exit(9)

    if RABBITMQ:
        from pika.adapters.blocking_connection import BlockingChannel  # type: ignore[import-untyped]

        BlockingChannel.basic_publish = die
    else:
        broker.do_enqueue = die  # type: ignore[attr-defined]


def _die_inside_the_send_script() -> None:
    from dramatiq_unique.backends.redis.calls import ScriptCalls, _pack

    exchange = ScriptCalls._exchange

    def die(self: ScriptCalls, conn: Any, commands: list[Any]) -> Any:
        sends = {sha for name, sha in self.shas.items() if name.startswith("send:")}
        if commands[0][1] not in sends:
            return exchange(self, conn, commands)
        conn.send_packed_command([b"".join(_pack(command) for command in commands)])
        os._exit(9)

    ScriptCalls._exchange = die  # type: ignore[method-assign]


def _die_before_confirming() -> None:
    from dramatiq_unique.send.confirm import Confirmer

    def die(*args: Any, **kwargs: Any) -> None:
        os._exit(9)

    Confirmer.submit = die  # type: ignore[method-assign]


if __name__ == "__main__":
    mode, queue, key = sys.argv[1:4]
    if mode == "die":
        _die_inside_publish()
    elif mode == "die-after-publish":
        _die_before_confirming()
    elif mode == "die-in-send":
        _die_inside_the_send_script()
    message = ACTORS[queue].send(key)
    print(json.dumps({"message_id": message.message_id, "duplicate_of": message.options.get("unique_duplicate_of")}))
