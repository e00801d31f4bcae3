"""What a ``replace`` send costs, next to an ``until_executed`` send.

A ``replace`` send takes its enqueue lock in one round trip
(``replace.lua``) before the broker's ``dispatch.lua``; an
``until_executed`` send of a new key takes the send fast path: one
round trip, ``send.lua``, that takes the lock and runs ``dispatch.lua``.
Each row names the round trips it counted per send, so a second trip
would show.
"""

from __future__ import annotations

import time
from collections import Counter
from statistics import median
from typing import Any

import dramatiq
import redis
from dramatiq.brokers.redis import RedisBroker

from dramatiq_unique import UniqueMiddleware
from dramatiq_unique.backends.redis import RedisBackend

from . import trips
from .app import QUEUE
from .costs import CallCost
from .runs import new_namespace
from .server import cleanup, command_usec

#: The two rows, before the round trips are filled in.
UNTIL_EXECUTED_SEND = "`until_executed` send of a new key ({trips})"
REPLACE_SEND = "`replace` send superseding the holder ({trips})"


def _trips(lock: float, combined: float) -> str:
    """The round trips of one send, per send: lock scripts alone, or the
    send fast path's lock and dispatch.lua in one script.
    """
    if combined:
        return f"{combined:g} round trip: the lock and dispatch.lua in send.lua" + (f", {lock:g} more" if lock else "")
    return f"{lock:g} lock round trip + dispatch.lua"


def job(key: int, seq: int) -> None:
    pass


def send_costs(client: redis.Redis, url: str, calls: int, chunk: int) -> list[CallCost]:
    """Time ``calls`` sends of each kind, in chunks taken in turn, and
    count the lock round trips of each.
    """
    namespace = new_namespace()
    broker = RedisBroker(url=url, namespace=namespace)
    broker.add_middleware(UniqueMiddleware(backend=RedisBackend(url=url), prefix=namespace))
    options: dict[str, Any] = {"broker": broker, "queue_name": QUEUE, "lock_args": ["key"]}
    until = dramatiq.actor(job, actor_name="until_executed", lock="until_executed", **options)
    replace = dramatiq.actor(job, actor_name="replace", lock="until_executed", on_conflict="replace", **options)
    kinds = [
        (UNTIL_EXECUTED_SEND, lambda i: until.send(i, i)),  # a new key every time
        (REPLACE_SEND, lambda i: replace.send(0, i)),  # one key: every send supersedes the last
    ]
    walls: dict[str, list[float]] = {name: [] for name, _ in kinds}
    server: Counter[str] = Counter()
    lock_trips: Counter[str] = Counter()
    combined_trips: Counter[str] = Counter()
    counting = trips._original is None
    trips.install()
    try:
        for _, send in kinds:
            send(-1)  # connects and loads the scripts; the replace key now has a holder
        for turn, first in enumerate(range(0, calls, chunk)):
            numbers = range(first, min(first + chunk, calls))
            for name, send in kinds[turn % 2 :] + kinds[: turn % 2]:
                trips.reset()
                usec = command_usec(client)["evalsha"]
                started = time.perf_counter()
                for i in numbers:
                    send(i)
                walls[name].append((time.perf_counter() - started) / len(numbers) * 1e6)
                server[name] += command_usec(client)["evalsha"] - usec
                # The sending thread's own: a lingering background thread of
                # another test in the same process is no part of a send.
                counted = trips.thread_counts().items()
                lock_trips[name] += sum(n for label, n in counted if trips.owner(label) == "lock")
                combined_trips[name] += sum(n for label, n in counted if trips.owner(label) == "lock+broker")
    finally:
        if counting:
            trips.uninstall()
        broker.close()
        cleanup(client, namespace)
    return [
        CallCost(
            name.format(trips=_trips(lock_trips[name] / calls, combined_trips[name] / calls)),
            median(values),
            server[name] / calls,
        )
        for name, values in walls.items()
    ]
