"""What every kind of run shares: a namespace per run, one worker
process per run, and the check that each job ran exactly once.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

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


def worker_settings(
    url: str, contender: str, namespace: str, expect: int, seconds: float, count_trips: bool
) -> dict[str, str]:
    """The ``BENCH_*`` variables :func:`benchmarks.app.from_environment` reads."""
    return {"BENCH_CONTENDER": contender, "BENCH_REDIS_URL": url, "BENCH_NAMESPACE": namespace,
            "BENCH_EXPECT": str(expect), "BENCH_SECONDS": str(seconds), "BENCH_TRIPS": "1" if count_trips else "0"}


def work(url: str, contender: str, namespace: str, expect: int, *, count_trips: bool = False) -> dict[str, Any]:
    """Run one worker on the ``expect`` jobs queued under ``namespace``
    until every one is acked, and return its report.
    """
    with WorkerProcess(worker_settings(url, contender, namespace, expect, 0.0, count_trips)) as worker:
        return worker.finish(timeout=60 + expect * 0.01)
