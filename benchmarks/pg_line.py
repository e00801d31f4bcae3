"""``python -m benchmarks.pg_line``: what one call costs on PostgreSQL
for a key with a long line of waiters.  A key of ``while_executing``
holds its lock; N messages join its line (``join_line``, a 450-byte
body each); then the median of 20 ``start`` calls of copies that come
back while their message is still in line (they change nothing), and
the size of the key's row, as stored and as text.  On a private
PostgreSQL (or ``--url``).
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

from dramatiq_unique.backends.postgres import PostgresBackend, sql
from dramatiq_unique.backends.records import Copy

from .pg_server import PrivatePostgres

KEY = "bench:hold:{k}:run"
BODY = b"x" * 450


def measure(backend: PostgresBackend, sizes: list[int]) -> list[tuple[int, float, int, int]]:
    """For each line length: (waiters, median ms of a returning copy's start, row bytes stored, as text)."""
    backend.acquire(KEY, "holder", ttl=600_000)
    ids: list[str] = []
    rows = []
    for size in sizes:
        while len(ids) < size:
            ids.append(str(uuid.uuid4()))
            backend.join_line(Copy(KEY, ids[-1], attempt=1, via="delay"), BODY, order=len(ids), ttl=600_000)
        times = []
        for place, message_id in list(enumerate(ids, 1))[-20:]:
            began = time.perf_counter()
            copy = Copy(KEY, message_id, attempt=2, via="delay")
            backend.start(KEY, message_id, ttl=10_000, limit=1, lock="while_executing", copy=copy, order=place)
            times.append((time.perf_counter() - began) * 1000)
        with backend._connection() as conn:
            stored, text = conn.execute(
                f"SELECT sum(pg_column_size(state)), sum(length(state::text)) FROM {sql.LOCKS}"
            ).fetchone()
        rows.append((size, statistics.median(times) if times else 0.0, int(stored), int(text)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a PostgreSQL database to use (default: a private cluster)")
    parser.add_argument("--sizes", default="0,50,200,1000", help="line lengths, comma-separated")
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    server = PrivatePostgres().start() if args.url is None else None
    backend = PostgresBackend(url=args.url or server.url)  # type: ignore[union-attr]
    try:
        print("| waiters | ms per call (median) | row bytes stored | row bytes as text |\n|---|---|---|---|")
        for size, ms, stored, text in measure(backend, sizes):
            print(f"| {size:,} | {ms:.2f} | {stored:,} | {text:,} |")
    finally:
        backend.close()
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
