"""What ``min_replicas=1`` costs: bare Dramatiq, ``while_executing``
and ``while_executing`` with ``dramatiq_unique_min_replicas=1``, on a
private primary with one replica, within the same rounds.

``python -m benchmarks.replicas [--rounds N] [--jobs N]``: a
configuration of its own, run apart from the full harness (it needs a
replica, which no other configuration has).  Every ratio is taken
within one round, and the medians are printed.
"""

from __future__ import annotations

import argparse
import time
from statistics import median
from typing import Optional, Sequence

import redis

from .app import BARE
from .runs import DEFAULT, Config
from .server import PrivateRedis
from .throughput import close, enqueue_round, process_run

WHILE = "while_executing"

#: The worker of the third contender: every run lock waits for one replica.
MIN_REPLICAS_1 = Config("min_replicas=1", env={"dramatiq_unique_min_replicas": "1"})


def with_replica() -> tuple[PrivateRedis, PrivateRedis]:
    """A private primary and one replica of it, in sync."""
    primary, replica = PrivateRedis().start(), PrivateRedis().start()
    link = redis.Redis.from_url(replica.url)
    link.execute_command("REPLICAOF", "127.0.0.1", str(primary.port))
    deadline = time.monotonic() + 10
    while link.info("replication").get("master_link_status") != "up":
        if time.monotonic() > deadline:
            raise RuntimeError("the replica never synced")
        time.sleep(0.05)
    return primary, replica


def one_round(client: redis.Redis, url: str, jobs: int) -> tuple[float, float, float]:
    """The processing rates of bare, while_executing and while_executing
    with ``min_replicas=1``, each on ``jobs`` distinct keys.
    """
    senders = enqueue_round(client, url, [BARE, WHILE, WHILE], jobs, 100)
    try:
        bare, plain, acked = (
            process_run(client, url, sender, config=config)
            for sender, config in zip(senders, (DEFAULT, DEFAULT, MIN_REPLICAS_1))
        )
        if not (bare.exactly_once and plain.exactly_once and acked.exactly_once):
            raise RuntimeError("a job did not run exactly once")
        return bare.rate, plain.rate, acked.rate
    finally:
        close(client, senders)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.replicas", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=3000)
    args = parser.parse_args(argv)
    primary, replica = with_replica()
    try:
        client = redis.Redis.from_url(primary.url)
        rates = [one_round(client, primary.url, args.jobs) for _ in range(args.rounds)]
    finally:
        replica.stop()
        primary.stop()
    for n, (bare, plain, acked) in enumerate(rates, 1):
        print(f"round {n}: bare {bare:.0f}/s, while_executing {plain:.0f}/s, +min_replicas=1 {acked:.0f}/s")
    print(f"while_executing / bare:                {median(p / b for b, p, _ in rates):.3f}")
    print(f"while_executing+min_replicas=1 / bare: {median(a / b for b, _, a in rates):.3f}")
    print(f"min_replicas=1 / while_executing:      {median(a / p for _, p, a in rates):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
