"""Enqueue and processing rates, commands and round trips per job, for
every contender on distinct keys.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

import redis

from . import app, trips
from .runs import DEFAULT, Config, Executions, new_namespace, work
from .server import cleanup, command_calls, delta, redis_cpu


@dataclass
class Sender:
    """One contender's sending side in one round, and what it measured."""

    contender: str
    namespace: str
    broker: Any
    actor: Any
    sent: int = 0
    seconds: float = 0.0
    commands: Counter[str] = field(default_factory=Counter)

    @property
    def rate(self) -> float:
        return self.sent / self.seconds


def enqueue_round(
    client: redis.Redis, url: str, contenders: list[str], sent: int, chunk: int, postgres_url: Optional[str] = None
) -> list[Sender]:
    """Send ``sent`` jobs on distinct keys for every contender, in
    chunks of ``chunk`` taken in turn, so that load from elsewhere hits
    every contender alike.  One thread, as a web request would send.
    """
    senders = []
    for contender in contenders:
        namespace = new_namespace()
        broker, actor = app.build(contender, redis_url=url, namespace=namespace, postgres_url=postgres_url)
        senders.append(Sender(contender, namespace, broker, actor))
    calls = command_calls(client)
    for turn, first in enumerate(range(0, sent, chunk)):
        for sender in senders[turn % len(senders) :] + senders[: turn % len(senders)]:
            started = time.perf_counter()
            for seq in range(first, min(first + chunk, sent)):
                sender.actor.send(seq, seq)
            sender.seconds += time.perf_counter() - started
            sender.sent = min(first + chunk, sent)
            after = command_calls(client)
            sender.commands += delta(calls, after)
            calls = after
    return senders


def close(client: redis.Redis, senders: list[Sender]) -> None:
    for sender in senders:
        sender.broker.close()
        cleanup(client, sender.namespace)


@dataclass
class Processing:
    """One worker process running one contender's queue of ``sent`` jobs."""

    contender: str
    sent: int
    rate: float
    exactly_once: bool
    commands: Counter[str]
    worker_cpu: Optional[float]
    worker_user_sys: Optional[tuple[float, float]]
    redis_cpu: float
    switches: Optional[tuple[int, int]] = None  # the worker's voluntary and involuntary context switches
    trips: dict[str, int] = field(default_factory=dict)
    worker_trips: dict[str, int] = field(default_factory=dict)
    events: dict[str, int] = field(default_factory=dict)
    release_latencies: list[float] = field(default_factory=list)


def process_run(
    client: redis.Redis, url: str, sender: Sender, *, count_trips: bool = False, config: Config = DEFAULT
) -> Processing:
    """Start one worker on the jobs ``sender`` sent and let it run them
    all.  The rate runs from the first start to the last end.
    """
    calls, cpu = command_calls(client), redis_cpu(client)
    report = work(url, sender.contender, sender.namespace, sender.sent, count_trips=count_trips, config=config)
    runs = Executions(sender.sent, [tuple(span) for span in report["runs"]])  # type: ignore[misc]
    return Processing(
        sender.contender,
        sender.sent,
        rate=sender.sent / runs.seconds,
        exactly_once=runs.exactly_once,
        commands=delta(calls, command_calls(client)),
        worker_cpu=report["cpu"],
        worker_user_sys=report.get("user_sys"),
        redis_cpu=redis_cpu(client) - cpu,
        switches=report.get("switches"),
        trips=report["trips"],
        worker_trips=report.get("worker_trips", {}),
        events=report["events"],
        release_latencies=report.get("release_latencies", []),
    )


def audit(client: redis.Redis, url: str, contender: str, sent: int) -> tuple[dict[str, int], Processing]:
    """Count the round trips of one contender: the driver's while it
    sends, the worker's while it runs.
    """
    trips.reset()
    trips.install()
    try:
        [sender] = enqueue_round(client, url, [contender], sent, sent)
    finally:
        trips.uninstall()
    sent_trips = {name: n for name, n in trips.counts().items() if name != "INFO"}
    try:
        return sent_trips, process_run(client, url, sender, count_trips=True)
    finally:
        close(client, [sender])
