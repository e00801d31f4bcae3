"""Redis keys and memory per held lock, through the real code path."""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import dramatiq
import redis
from dramatiq import Message
from dramatiq.broker import MessageProxy
from dramatiq.brokers.stub import StubBroker
from dramatiq.rate_limits import ConcurrentRateLimiter
from dramatiq.rate_limits.backends import RedisBackend as RateLimiterBackend

from dramatiq_unique import LOCK_TYPES, UniqueMiddleware
from dramatiq_unique.backends.redis import RedisBackend

from . import app
from .runs import new_namespace
from .server import cleanup


@dataclass
class Footprint:
    """Redis keys and memory per held lock, in one phase."""

    contender: str
    phase: str
    locks: int
    keys: float
    bytes: float  # MEMORY USAGE of the lock keys, per lock
    keys_left: float = 0.0


def footprints(client: redis.Redis, url: str, contender: str, locks: int) -> list[Footprint]:
    """Hold ``locks`` locks on distinct keys through the real code path,
    measure, release them, and count what is left.
    """
    if contender == app.RECIPE:
        return [_recipe_footprint(client, url, locks)]
    if contender in LOCK_TYPES:
        return _lock_footprints(client, url, contender, locks)
    return []


def _keys(client: redis.Redis, namespace: str, known: set[bytes]) -> list[bytes]:
    return [key for key in client.scan_iter(match=f"{namespace}*", count=1000) if key not in known]


def _measure(
    client: redis.Redis, namespace: str, known: set[bytes], contender: str, phase: str, locks: int
) -> Footprint:
    keys = _keys(client, namespace, known)
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.memory_usage(key, samples=0)
    sizes = pipe.execute() if keys else []
    return Footprint(contender, phase, locks, len(keys) / locks, sum(sizes) / locks)


def _lock_footprints(client: redis.Redis, url: str, lock: str, locks: int) -> list[Footprint]:
    namespace = new_namespace()
    broker = StubBroker()
    unique = UniqueMiddleware(backend=RedisBackend(url=url), prefix=namespace)
    broker.add_middleware(unique)

    def job(key: int, seq: int) -> None:
        pass

    actor = dramatiq.actor(broker=broker, actor_name="job", queue_name=app.QUEUE, lock=lock, lock_args=["key"])(job)
    spec = LOCK_TYPES[lock]
    measured = []
    try:
        _run_once(unique, broker, actor.send(-1, -1))  # loads the scripts; until_expired keeps this key
        known = set(_keys(client, namespace, set()))
        sent = [actor.send(seq, seq) for seq in range(locks)]
        if spec.queue_lock:
            measured.append(_measure(client, namespace, known, lock, "queued", locks))
        proxies = [MessageProxy(Message.decode(message.encode())) for message in sent]
        for proxy in proxies:
            unique.before_process_message(broker, proxy)
        if spec.run_lock:
            measured.append(_measure(client, namespace, known, lock, "running", locks))
        for proxy in proxies:
            unique.after_process_message(broker, proxy, result=None)
        for footprint in measured:
            footprint.keys_left = len(_keys(client, namespace, known)) / locks
    finally:
        unique.after_worker_shutdown(broker, None)  # type: ignore[arg-type]
        broker.close()
        cleanup(client, namespace)
    return measured


def _run_once(unique: UniqueMiddleware, broker: StubBroker, message: Message[Any]) -> None:
    proxy = MessageProxy(Message.decode(message.encode()))
    unique.before_process_message(broker, proxy)
    unique.after_process_message(broker, proxy, result=None)
    broker.flush_all()


def _recipe_footprint(client: redis.Redis, url: str, locks: int) -> Footprint:
    namespace = new_namespace()
    backend = RateLimiterBackend(url=url)
    try:
        with ExitStack() as held:
            for key in range(locks):
                held.enter_context(ConcurrentRateLimiter(backend, f"{namespace}:mutex:{key}", limit=1).acquire())
            measured = _measure(client, namespace, set(), app.RECIPE, "running", locks)
        measured.keys_left = len(_keys(client, namespace, set())) / locks
    finally:
        backend.client.close()
        cleanup(client, namespace)
    return measured
