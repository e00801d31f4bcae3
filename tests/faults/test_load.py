"""Case 7: many messages over few keys, random durations, reschedule on
conflict, several worker processes.

The default run is small enough for CI on two cores; ``--soak`` adds
the full size: 4 processes x 8 threads, 10,000 messages over 50 keys.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass

import pytest

from tests.conftest import wait_for
from tests.faults.harness import overlaps, peak


@dataclass(frozen=True)
class Size:
    processes: int
    threads: int
    messages: int  # to while_executing keys
    keys: int
    limited: int  # to the one lock_limit=3 key
    longest_s: float  # of a while_executing job
    timeout_s: float


SIZES = {
    "small": Size(processes=2, threads=4, messages=1_500, keys=20, limited=30, longest_s=0.02, timeout_s=180),
    "full": Size(processes=4, threads=8, messages=10_000, keys=50, limited=120, longest_s=0.02, timeout_s=1800),
}


@pytest.mark.parametrize("size", ["small", pytest.param("full", marks=[pytest.mark.soak, pytest.mark.timeout(3600)])])
def test_under_load_no_key_overlaps_and_every_message_runs_once(make_harness, figure, size):
    size = SIZES[size]
    rng = random.Random(20261129)
    h = make_harness("redis", FAULTS_LEASE="10000", FAULTS_RESCHEDULE_DELAY="100")
    # Given every message queued up front, so keys are contended from the start
    sent = [h.app.hold.send(f"key-{rng.randrange(size.keys)}", seconds=rng.uniform(0, size.longest_s)).message_id
            for _ in range(size.messages)]
    sent += [h.app.limited.send("limited", seconds=rng.uniform(0.05, 0.15)).message_id for _ in range(size.limited)]
    # When the workers drain them
    began = time.time()
    h.workers(processes=size.processes, threads=size.threads)
    wait_for(lambda: h.records.llen(f"{h.namespace}:runs") >= len(sent), timeout=size.timeout_s, interval=0.5,
             what=f"{len(sent)} runs")
    drained = time.time() - began
    wait_for(lambda: h.queued() == 0, timeout=60, what="nothing left in flight")
    runs = h.runs()
    # Then every message ran exactly once, and no run was cut short
    ran = Counter(r.message_id for r in runs)
    duplicates = sum(n - 1 for n in ran.values() if n > 1)
    lost = len(set(sent) - set(ran))
    # And no two runs of one while_executing key overlapped
    overlapping = overlaps([r for r in runs if r.actor == "hold"])
    # And the lock_limit=3 key ran exactly 3 at a time at its peak
    limited_peak = peak([r for r in runs if r.actor == "limited"])
    figure("messages", len(sent))
    figure("drained_s", round(drained, 1))
    figure("throughput_per_s", round(len(sent) / drained))
    figure("overlaps", len(overlapping))
    figure("lost", lost)
    figure("duplicates", duplicates)
    figure("limited_peak", limited_peak)
    figure("lock_lost", len(h.events("lock_lost")))
    twice = [r for r in runs if ran[r.message_id] > 1]
    assert (lost, duplicates, len(runs), len(h.starts())) == (0, 0, len(sent), len(sent)), f"ran twice: {twice}"
    assert overlapping == []
    assert limited_peak == 3
    assert h.events("lock_lost") == [] and h.events("backend_error") == []
