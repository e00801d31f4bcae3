"""The send fast path: on the Redis broker's own Redis, one round trip
takes the enqueue lock and enqueues, exactly as Dramatiq's own enqueue
would, and a refused duplicate enqueues nothing.
"""

from __future__ import annotations

import json
import threading
import uuid
from typing import Any, Iterator

import dramatiq
import pytest
import redis
from dramatiq.brokers.redis import RedisBroker

from dramatiq_unique import UniqueMiddleware
from dramatiq_unique.sendpath import dispatch_source

from .conftest import make_worker, wait_for


class Hooks(dramatiq.Middleware):
    """Records every enqueue hook it sees."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def before_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
        message.options["stamped_by_hooks"] = True  # a change Dramatiq must encode
        self.seen.append(("before", message.message_id))

    def after_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
        self.seen.append(("after", message.message_id))


@pytest.fixture
def broker(redis_url: str, redis_client: redis.Redis) -> Iterator[RedisBroker]:
    broker = RedisBroker(url=redis_url, namespace=f"t-{uuid.uuid4().hex[:8]}")
    broker.emit_after("process_boot")
    yield broker
    broker.close()


def evalshas(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def stored(client: redis.Redis, broker: RedisBroker, queue: str) -> list[dict[str, Any]]:
    ids = client.lrange(f"{broker.namespace}:{queue}", 0, -1)
    return [json.loads(client.hget(f"{broker.namespace}:{queue}.msgs", i)) for i in ids]


def test_one_round_trip_enqueues_what_dramatiq_enqueues_and_a_worker_runs_it(broker, redis_client):
    # Given a middleware whose locks live in the broker's own Redis, behind another middleware's hooks
    hooks = Hooks()
    broker.add_middleware(hooks)
    broker.add_middleware(UniqueMiddleware(prefix=broker.namespace))
    ran = []

    @dramatiq.actor(broker=broker, lock="until_executed", lock_args=["key"])
    def job(key: int) -> None:
        ran.append(key)

    job.send(0)  # loads the scripts
    # When a new message is sent
    before = evalshas(redis_client)
    sent = job.send(1)
    # Then it took one script call, the lock and the message both
    assert evalshas(redis_client) - before == 1
    assert "do_enqueue" in broker.__dict__
    [_, queued] = stored(redis_client, broker, "default")
    assert queued["message_id"] == sent.message_id and queued["options"]["stamped_by_hooks"] is True
    assert queued["options"]["redis_message_id"] == sent.options["redis_message_id"]
    assert redis_client.zscore(f"{broker.namespace}:__heartbeats__", broker.broker_id) is not None
    assert [seen for seen in hooks.seen if seen[1] == sent.message_id] == [("before", sent.message_id),
                                                                           ("after", sent.message_id)]
    # And a Dramatiq worker runs it and releases the lock
    worker = make_worker(broker, threads=2)
    try:
        wait_for(lambda: sorted(ran) == [0, 1], what="the jobs to run")
        wait_for(lambda: not redis_client.keys(f"{broker.namespace}:*:queue"), what="the lock to be released")
    finally:
        worker.stop()


def test_a_refused_duplicate_enqueues_nothing_and_fires_no_after_hook(broker, redis_client):
    # Given a sent message holding its lock
    hooks = Hooks()
    broker.add_middleware(hooks)
    broker.add_middleware(UniqueMiddleware(prefix=broker.namespace))

    @dramatiq.actor(broker=broker, lock="until_executed", lock_args=["key"])
    def job(key: int) -> None:
        pass

    first = job.send(1)
    # When a duplicate is sent
    duplicate = job.send(1)
    # Then it is refused, nothing more is queued, and its hooks are those of a refused send
    assert duplicate.options["unique_duplicate_of"] == first.message_id
    assert [m["message_id"] for m in stored(redis_client, broker, "default")] == [first.message_id]
    assert ("after", duplicate.message_id) not in hooks.seen
    # And a delayed send of another key goes to the delay queue with its eta, as Dramatiq puts it
    later = job.send_with_options(args=(2,), delay=60_000)
    [delayed] = stored(redis_client, broker, "default.DQ")
    assert delayed["message_id"] == later.message_id and delayed["options"]["eta"] == later.options["eta"]


def test_many_threads_sending_one_key_enqueue_it_once(broker, redis_client):
    # Given the fast path
    broker.add_middleware(UniqueMiddleware(prefix=broker.namespace))

    @dramatiq.actor(broker=broker, lock="until_executed", lock_args=["key"])
    def job(key: int) -> None:
        pass

    # When 8 threads send the same key 20 times each
    results: list[Any] = []

    def send() -> None:
        for _ in range(20):
            results.append(job.send(7))

    threads = [threading.Thread(target=send) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # Then exactly one was enqueued and every other send names it
    [queued] = stored(redis_client, broker, "default")
    accepted = [m for m in results if "unique_duplicate_of" not in m.options]
    assert [m.message_id for m in accepted] == [queued["message_id"]]
    assert {m.options["unique_duplicate_of"] for m in results if m not in accepted} == {queued["message_id"]}


def test_a_later_before_enqueue_or_an_unknown_broker_takes_the_two_step_path(broker, redis_client, redis_url):
    # Given a middleware with a before_enqueue after ours
    broker.add_middleware(UniqueMiddleware(prefix=broker.namespace))
    hooks = Hooks()
    broker.add_middleware(hooks)

    @dramatiq.actor(broker=broker, lock="until_executed", lock_args=["key"])
    def job(key: int) -> None:
        pass

    job.send(0)  # loads the scripts
    # When a message and its duplicate are sent
    before = evalshas(redis_client)
    first = job.send(1)
    duplicate = job.send(1)
    # Then the lock was taken apart from the enqueue, and the later middleware never saw the duplicate
    assert evalshas(redis_client) - before == 3
    assert duplicate.options["unique_duplicate_of"] == first.message_id
    assert [seen for seen in hooks.seen if seen[1] == duplicate.message_id] == []

    # And a subclass of RedisBroker, whose enqueue may differ, is never routed through the fast path
    class MyBroker(RedisBroker):
        pass

    assert dispatch_source(MyBroker(url=redis_url, namespace="t-sub")) is None
    assert dispatch_source(broker) is not None
