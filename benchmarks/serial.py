"""Long and same-key ``while_executing`` jobs: the makespan of one key's
jobs with the fast hand-off, and how lease renewals are batched.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis

from . import app
from .runs import Executions, new_namespace, worker_settings
from .server import cleanup
from .workers import WorkerProcess


@dataclass
class MakespanRun:
    """``jobs`` jobs of ``seconds`` for one key under ``while_executing``."""

    jobs: int
    seconds: float
    makespan: float
    handoffs: list[float]
    exactly_once: bool
    overlaps: int
    rescheduled: int


def makespan_run(client: redis.Redis, url: str, jobs: int, seconds: float = 0.1) -> MakespanRun:
    """Send ``jobs`` same-key jobs, run them with default settings, and
    wait until every rescheduled safety-net copy has come back and been
    skipped, so that a second execution would be seen.
    """
    namespace = new_namespace()
    broker, actor = app.build("while_executing", redis_url=url, namespace=namespace, seconds=seconds)
    queues = [f"{namespace}:{app.QUEUE}.msgs", f"{namespace}:{app.QUEUE}.DQ.msgs"]

    def drain() -> None:
        deadline = time.monotonic() + 120
        while any(client.hlen(queue) for queue in queues):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the queues of {namespace} did not drain in 120 s")
            time.sleep(0.05)

    try:
        for seq in range(jobs):
            actor.send(0, seq)
        with WorkerProcess(worker_settings(url, "while_executing", namespace, jobs, seconds, False)) as worker:
            worker.wait_progress(timeout=60 + jobs * seconds * 10)
            drain()
            report = worker.stop()
    finally:
        broker.close()
        cleanup(client, namespace)
    runs = Executions(jobs, [tuple(span) for span in report["runs"]])  # type: ignore[misc]
    ordered = sorted(runs.spans, key=lambda span: span[1])
    return MakespanRun(
        jobs,
        seconds,
        makespan=runs.seconds,
        handoffs=[b[1] - a[2] for a, b in zip(ordered, ordered[1:])],
        exactly_once=runs.exactly_once,
        overlaps=runs.overlaps,
        rescheduled=report["events"].get("rescheduled", 0),
    )


@dataclass
class Renewals:
    """Lease renewals of long ``while_executing`` jobs in one process."""

    jobs: int
    seconds: float
    lease: int
    extends: int  # leases renewed
    round_trips: int  # round trips that carried them


def renewal_run(client: redis.Redis, url: str, jobs: int, seconds: float, lease: int) -> Renewals:
    """Run ``jobs`` jobs on distinct keys that outlive several renewal
    intervals of a short ``lease``, and count the renewal round trips.
    """
    namespace = new_namespace()
    broker, actor = app.build("while_executing", redis_url=url, namespace=namespace, seconds=seconds)
    try:
        for seq in range(jobs):
            actor.send(seq, seq)
        settings = worker_settings(url, "while_executing", namespace, jobs, seconds, True)
        with WorkerProcess({**settings, "dramatiq_unique_lease": str(lease)}) as worker:
            report = worker.finish(timeout=60 + jobs * seconds)
    finally:
        broker.close()
        cleanup(client, namespace)
    carried = {name: n for name, n in report["trips"].items() if name.startswith("lock:extend")}
    extends = sum(n * int(name.partition(" x")[2] or 1) for name, n in carried.items())
    return Renewals(jobs, seconds, lease, extends, sum(carried.values()))
