"""Take + release from Python: PostgresBackend (``synchronous_commit``
as the server has it, and off) beside RedisBackend, one thread and 8.

  python -m benchmarks.postgres_locks --postgres postgresql://postgres@127.0.0.1/db --redis redis://127.0.0.1:6379/11

Each pair takes a run lock of a key of its own thread and releases it.
It prints the median milliseconds per pair on one thread, and pairs
per second over 8 threads; and, as the server's floor, the median of
one committed single-row upsert (synchronous_commit on and off).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import uuid
from typing import Any, Callable

from dramatiq_unique.backends.base import LockBackend

DEFAULT_PAIRS = 300

#: The floor: one committed single-row write.
FLOOR = "INSERT INTO dramatiq_unique_bench_floor AS f VALUES ('k', 1) ON CONFLICT (k) DO UPDATE SET v = f.v + 1"
DEFAULT_THREADS = 8
DEFAULT_SECONDS = 3.0


def pair(backend: LockBackend, key: str) -> None:
    owner = uuid.uuid4().hex
    assert backend.acquire(key, owner, ttl=60_000).acquired
    backend.release(key, owner)


def single(backend: LockBackend, pairs: int) -> float:
    """The median milliseconds per take + release on one thread."""
    key = f"bench:{uuid.uuid4().hex}:{{k}}:run"
    pair(backend, key)
    times = []
    for _ in range(pairs):
        started = time.perf_counter()
        pair(backend, key)
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def threaded(backend: LockBackend, threads: int, seconds: float) -> float:
    """Take + release pairs per second over ``threads`` threads."""
    done = [0] * threads
    until = time.monotonic() + seconds

    def run(n: int) -> None:
        key = f"bench:{uuid.uuid4().hex}:{{k}}:run"
        while time.monotonic() < until:
            pair(backend, key)
            done[n] += 1

    workers = [threading.Thread(target=run, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return sum(done) / seconds


def floor(url: str, pairs: int) -> str:
    """The median milliseconds of one committed single-row upsert, with
    ``synchronous_commit`` on and off.
    """
    import psycopg

    medians = []
    with psycopg.connect(url, autocommit=True, prepare_threshold=None) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS dramatiq_unique_bench_floor (k text PRIMARY KEY, v int)")
        for setting in ("on", "off"):
            conn.execute(f"SET synchronous_commit = {setting}")
            times = []
            for _ in range(pairs):
                started = time.perf_counter()
                conn.execute(FLOOR)
                times.append((time.perf_counter() - started) * 1000)
            medians.append(f"{statistics.median(times):.3f} ms ({setting})")
        conn.execute("DROP TABLE dramatiq_unique_bench_floor")
    return ", ".join(medians)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--postgres", required=True)
    parser.add_argument("--redis")
    parser.add_argument("--pairs", type=int, default=DEFAULT_PAIRS)
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    parser.add_argument("--seconds", type=float, default=DEFAULT_SECONDS)
    args = parser.parse_args()
    from dramatiq_unique.backends.postgres import PostgresBackend

    makers: dict[str, Callable[[], Any]] = {
        "postgres, synchronous_commit as the server": lambda: PostgresBackend(url=args.postgres, max_size=16),
        "postgres, synchronous_commit=off": lambda: PostgresBackend(
            url=args.postgres, max_size=16, synchronous_commit="off"),
    }
    if args.redis:
        from dramatiq_unique.backends.redis import RedisBackend

        makers["redis"] = lambda: RedisBackend(url=args.redis)
    print(f"floor, one committed single-row upsert: {floor(args.postgres, args.pairs)}")
    for name, make in makers.items():
        backend = make()
        ms = single(backend, args.pairs)
        rate = threaded(backend, args.threads, args.seconds)
        print(f"{name}: {ms:.3f} ms per take+release (median, 1 thread); {rate:,.0f} pairs/s ({args.threads} threads)")
        close = getattr(backend, "close", None)
        if close is not None:
            close()


if __name__ == "__main__":
    main()
