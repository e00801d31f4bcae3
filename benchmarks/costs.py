"""What single calls cost: a bare send, a ``PING``, each lock script,
and the middleware's own Python.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from dataclasses import dataclass
from statistics import median
from typing import Any, Optional

import dramatiq
import redis
from dramatiq import Message
from dramatiq.broker import MessageProxy
from dramatiq.brokers.stub import StubBroker

from dramatiq_unique import DEFAULT_LEASE, DEFAULT_LOCK_TTL, Acquisition, Release, UniqueMiddleware
from dramatiq_unique.backends import StubBackend
from dramatiq_unique.backends.redis import RedisBackend

from . import app
from .runs import new_namespace
from .server import cleanup, command_usec


#: The name of a bare send in :func:`call_costs`.
SEND = "bare send (one dispatch.lua)"
#: A send of an ``until_executed`` actor on the broker's own Redis: the
#: send fast path.
LOCKED_SEND = "`until_executed` send (one send.lua: the lock, then dispatch.lua)"


@dataclass
class CallCost:
    """What one call costs, seen from one driver thread."""

    name: str
    wall: float  # microseconds per call, median over chunks
    server: Optional[float]  # microseconds of server time per call (INFO commandstats)


def call_costs(client: redis.Redis, url: str, calls: int, chunk: int) -> list[CallCost]:
    """Time a bare send, a PING and each lock script, in chunks taken
    in turn; each script's release follows its acquire on the same keys.
    """
    namespace = new_namespace()
    backend = RedisBackend(url=url)
    broker, actor = app.build(app.BARE, redis_url=url, namespace=namespace)
    locked_broker, locked = app.build("until_executed", redis_url=url, namespace=namespace + "-locked")
    owners = [uuid.uuid4().hex for _ in range(calls)]
    queue_key, run_key = f"{namespace}:job:{{q%d}}:queue", f"{namespace}:job:{{r%d}}:run"
    groups = [
        [(SEND, "evalsha", lambda i: actor.send(i, i))],
        [(LOCKED_SEND, "evalsha", lambda i: locked.send(i, i))],
        [("PING", "ping", lambda i: backend.client.ping())],
        [("enqueue lock: acquire", "evalsha",
          lambda i: backend.acquire(queue_key % i, owners[i], ttl=DEFAULT_LOCK_TTL, lock="until_executed")),
         ("enqueue lock: release", "evalsha", lambda i: backend.release(queue_key % i, owners[i]))],
        [("run lock: acquire", "evalsha",
          lambda i: backend.acquire(run_key % i, f"{owners[i]}/0", ttl=DEFAULT_LEASE, lock="while_executing")),
         ("run lock: release", "evalsha", lambda i: backend.release(run_key % i, f"{owners[i]}/0"))],
    ]
    walls: dict[str, list[float]] = {name: [] for group in groups for name, _, _ in group}
    server: Counter[str] = Counter()
    try:
        for op in (op for group in groups for op in group):
            op[2](-1)  # connects and loads the scripts
        for turn, first in enumerate(range(0, calls, chunk)):
            numbers = range(first, min(first + chunk, calls))
            for group in groups[turn % len(groups) :] + groups[: turn % len(groups)]:
                for name, command, call in group:
                    usec = command_usec(client)[command]
                    started = time.perf_counter()
                    for i in numbers:
                        call(i)
                    walls[name].append((time.perf_counter() - started) / len(numbers) * 1e6)
                    server[name] += command_usec(client)[command] - usec
    finally:
        broker.close()
        locked_broker.close()
        backend.client.close()
        cleanup(client, namespace)
    return [CallCost(name, median(values), server[name] / calls) for name, values in walls.items()]


#: The middleware's own costs, from :func:`hook_costs`.
HOOKS = "UniqueMiddleware hooks of one job, backend excluded"
ENQUEUE_HOOK = "UniqueMiddleware enqueue hook (`until_executed`), backend excluded"


class _AnsweringBackend(StubBackend):
    """Grants and releases every lock at once, so that timing the hooks
    measures the middleware's own Python.
    """

    def acquire(self, key: str, owner: str, **options: Any) -> Acquisition:
        return Acquisition(True, fence=1)

    def release(self, key: str, owner: str, *, hand_over: bool = True) -> Release:
        return Release(True)


def hook_costs(calls: int) -> list[CallCost]:
    """CPU microseconds of the middleware's own work: taking an enqueue
    lock in ``before_enqueue``, and the ``before_process_message`` and
    ``after_process_message`` of a ``while_executing`` job.
    """
    broker = StubBroker()
    unique = UniqueMiddleware(backend=_AnsweringBackend())
    broker.add_middleware(unique)

    def job(key: int, seq: int) -> None:
        pass

    runs = dramatiq.actor(broker=broker, actor_name="runs", lock="while_executing", lock_args=["key"])(job)
    sends = dramatiq.actor(broker=broker, actor_name="sends", lock="until_executed", lock_args=["key"])(job)
    proxies = [MessageProxy(Message.decode(runs.send(seq, seq).encode())) for seq in range(calls)]
    messages = [sends.message(seq, seq) for seq in range(calls)]
    try:
        started = time.process_time()
        for message in messages:
            unique.before_enqueue(broker, message, None)
        enqueue = (time.process_time() - started) / calls * 1e6
        started = time.process_time()
        for proxy in proxies:
            unique.before_process_message(broker, proxy)
            unique.after_process_message(broker, proxy, result=None)
        process = (time.process_time() - started) / calls * 1e6
        return [CallCost(ENQUEUE_HOOK, enqueue, None), CallCost(HOOKS, process, None)]
    finally:
        unique.after_worker_shutdown(broker, None)  # type: ignore[arg-type]
        broker.close()
