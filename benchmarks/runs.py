"""What every kind of run shares: a namespace per run, one worker
process per run, and the check that each job ran exactly once.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping

from .workers import WorkerProcess


def new_namespace() -> str:
    return f"bench-{uuid.uuid4().hex[:8]}"


@dataclass
class Executions:
    """What one worker ran, checked against what was sent."""

    sent: int
    spans: list[tuple[int, float, float]]

    @property
    def exactly_once(self) -> bool:
        return sorted(seq for seq, _, _ in self.spans) == list(range(self.sent))

    @property
    def overlaps(self) -> int:
        """Runs that started before the previous one ended (same key)."""
        ordered = sorted(self.spans, key=lambda span: span[1])
        return sum(1 for a, b in zip(ordered, ordered[1:]) if b[1] < a[2])

    @property
    def seconds(self) -> float:
        return max(end for _, _, end in self.spans) - min(start for _, start, _ in self.spans)


@dataclass(frozen=True)
class Config:
    """How the worker runs and what the job does, beyond the defaults."""

    name: str
    seconds: float = 0.0  # the job sleeps this long
    cpu: float = 0.0  # the job spins for this much CPU
    env: Mapping[str, str] = field(default_factory=dict)  # e.g. dramatiq_queue_prefetch
    replicas: int = 0  # replicas of the harness's Redis, attached for this configuration's rounds


#: The default worker (8 threads, Dramatiq's prefetch of 16) and no-op job.
DEFAULT = Config("default")
#: Where bare Dramatiq is CPU-bound: a prefetch window of 64.
PREFETCH_64 = Config("prefetch 64", env={"dramatiq_queue_prefetch": "64"})
SLEEP_1MS = Config("1 ms sleep job", seconds=0.001)
CPU_1MS = Config("1 ms CPU job", cpu=0.001)
#: Failover protection: one replica of the Redis, and every run lock
#: waits for it to acknowledge the take (Redis ``WAIT``); bare Dramatiq's
#: broker writes are replicated too.
MIN_REPLICAS_1 = Config("one replica, min_replicas=1", env={"dramatiq_unique_min_replicas": "1"}, replicas=1)


def worker_settings(
    url: str, contender: str, namespace: str, expect: int, seconds: float, count_trips: bool
) -> dict[str, str]:
    """The ``BENCH_*`` variables :func:`benchmarks.app.from_environment` reads."""
    return {"BENCH_CONTENDER": contender, "BENCH_REDIS_URL": url, "BENCH_NAMESPACE": namespace,
            "BENCH_EXPECT": str(expect), "BENCH_SECONDS": str(seconds), "BENCH_TRIPS": "1" if count_trips else "0"}


def work(
    url: str, contender: str, namespace: str, expect: int, *, count_trips: bool = False, config: Config = DEFAULT
) -> dict[str, Any]:
    """Run one worker on the ``expect`` jobs queued under ``namespace``
    until every one is acked, and return its report.
    """
    settings = worker_settings(url, contender, namespace, expect, config.seconds, count_trips)
    settings = {**settings, "BENCH_CPU": str(config.cpu), **config.env}
    with WorkerProcess(settings) as worker:
        return worker.finish(timeout=60 + expect * (0.01 + config.seconds + config.cpu * 8))
