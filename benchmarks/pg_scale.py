"""PostgresBackend at scale (issue 36, "Flat at scale"): the figures of a
table holding many ``until_executed`` locks.

  python -m benchmarks.pg_scale [--url URL] [--locks 100000] [--cycles 1000000] [--threads 8] [--pairs 2000]
      [--output PATH]

It runs on a private PostgreSQL (``fsync`` on, see :mod:`.pg_server`), or
on the server at URL, in two databases it makes and drops: one whose lock
table stays empty, one that it fills.

1. Fill: one enqueue lock is taken through the backend, and its row copied
   ``--locks - 1`` times by one ``INSERT ... SELECT generate_series`` with
   its key and owner replaced, so every row is one the backend writes;
   a few are read back through the backend.  Then ``VACUUM ANALYZE``.
2. Per job: a run lock's take (``start``) and release on a fresh key, on
   one thread, one pair on the empty table then one on the full, so that
   the machine's load falls on both alike; the ratio of each chunk of 100
   pairs a table gives the spread.  A released key keeps its fence for an
   hour: each chunk's rows are deleted after it, untimed.
3. Sweep: rows spread over the table expire (``expires_at`` set in the
   past); one ``sweep()`` is timed; pairs are timed while a sweep runs on
   another thread and after it; and the lock call that starts a due sweep
   (the backend's own, on its thread) is timed.  Swept rows are put back.
4. Cycles: ``--cycles`` take + release pairs on ``--threads`` threads, each
   on its own share of 10,000 run-lock keys, the backend's transactions with
   ``synchronous_commit`` off; the table's size and ``pg_stat_user_tables``
   are sampled every tenth of the run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import threading
import time
import uuid
from collections import Counter
from typing import Any, Optional

from dramatiq_unique.backends.postgres import PostgresBackend, sql
from dramatiq_unique.backends.postgres.backend import DEFAULT_SWEEP_BATCHES
from dramatiq_unique.backends.records import Copy

from .pg_server import PrivatePostgres, version

TTL, LEASE = 3_600_000, 60_000  # the enqueue locks' ttl, the run locks' lease
CHUNK, PAIRS, EXPIRED, DIGESTS, SWEEP_ROUNDS = 100, 2_000, 5_000, 10_000, 5
NEVER = 10**9  # a sweep_interval that never comes: the figure's sweeps are run by hand
PAIRS_SESSION = "bench-scale-pairs"  # the application_name of the timed pairs' sessions

#: The copies of lock 0's row: lock i for every i in [first, last] with i % every = phase.
NUMBERS = "FROM generate_series(%(first)s::int, %(last)s::int) AS i WHERE i %% %(every)s::int = %(phase)s::int"
FILL = f"""INSERT INTO {sql.LOCKS} (key, state, expires_at)
    SELECT 'bench:once:{{' || md5(i::text) || '}}:queue',
        replace(t.state::text, %(owner)s, md5('m' || i)::uuid::text)::jsonb, t.expires_at
    FROM {sql.LOCKS} AS t, LATERAL (SELECT i {NUMBERS}) AS n WHERE t.key = %(key)s"""
EXPIRE = f"""UPDATE {sql.LOCKS} SET expires_at = now() - interval '1 minute'
    WHERE key IN (SELECT 'bench:once:{{' || md5(i::text) || '}}:queue' {NUMBERS})"""
SIZES = f"""SELECT pg_total_relation_size(relid), pg_relation_size(relid), pg_indexes_size(relid), n_live_tup,
    n_dead_tup, autovacuum_count, extract(epoch FROM now() - last_autovacuum)::int, n_tup_upd, n_tup_hot_upd,
    (SELECT count(*) FROM {sql.LOCKS} WHERE expires_at > now())
    FROM pg_stat_user_tables WHERE relname = '{sql.LOCKS}'"""
#: The rows of the pairs on fresh keys (each keeps its fence for an hour).
JOBS_DELETE = f"DELETE FROM {sql.LOCKS} WHERE key LIKE 'bench:job:%'"
SAMPLE_NAMES = ("total", "table", "indexes", "n_live_tup", "n_dead_tup", "autovacuum_count",
                "last_autovacuum_s_ago", "n_tup_upd", "n_tup_hot_upd", "unexpired")


def queue_key(i: int) -> str:
    return f"bench:once:{{{hashlib.md5(str(i).encode()).hexdigest()}}}:queue"


def message_id(i: int) -> str:
    return str(uuid.UUID(hashlib.md5(f"m{i}".encode()).hexdigest()))


def pair(backend: PostgresBackend, key: str) -> float:
    """What a worker does per job: take the run lock, release it; in ms."""
    owner = f"{uuid.uuid4()}/0"
    started = time.perf_counter()
    got = backend.start(key, owner, ttl=LEASE, limit=1, lock="while_executing", copy=Copy(key, owner[:-2]))
    assert got.acquisition.acquired, got
    backend.release(key, owner)
    return (time.perf_counter() - started) * 1000


def fresh_pair(backend: PostgresBackend) -> float:
    return pair(backend, f"bench:job:{{{uuid.uuid4().hex}}}:run")


def p95(times: list[float]) -> float:
    return statistics.quantiles(times, n=20)[18] if len(times) > 1 else times[0]


class Scale:
    """The two databases, their backends, and the figures so far."""

    def __init__(self, url: str, locks: int, pairs: int = PAIRS) -> None:
        import psycopg
        from psycopg.conninfo import make_conninfo

        self.url, self.locks, self.pairs = url, locks, pairs
        self.figures: dict[str, Any] = {}
        self.names = [f"du_scale_{name}_{os.getpid()}" for name in ("empty", "full")]
        with psycopg.connect(url, autocommit=True) as conn:
            for name in self.names:
                conn.execute(f"CREATE DATABASE {name}")
        self.empty_url, self.full_url = (make_conninfo(url, dbname=name) for name in self.names)
        self.conn = psycopg.connect(self.full_url, autocommit=True)
        self.empty_conn = psycopg.connect(self.empty_url, autocommit=True)
        self.empty = PostgresBackend(url=self.empty_url, sweep_interval=NEVER)
        self.full = PostgresBackend(url=self.full_url, sweep_interval=NEVER, application_name=PAIRS_SESSION)
        self.expired = min(EXPIRED, locks // 10)  # so that phases 0 to 6 are 7 sets of rows
        self.every = max(locks // max(self.expired, 1), 1)

    def close(self) -> None:
        import psycopg

        self.empty.close()
        self.full.close()
        self.conn.close()
        self.empty_conn.close()
        with psycopg.connect(self.url, autocommit=True) as conn:
            for name in self.names:
                conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    def numbers(self, phase: int) -> dict[str, Any]:
        return {"first": 1, "last": self.locks - 1, "every": self.every, "phase": phase,
                "owner": message_id(0), "key": queue_key(0)}

    def sizes(self) -> dict[str, Any]:
        row = self.conn.execute(SIZES).fetchone()
        assert row is not None
        return dict(zip(SAMPLE_NAMES, row))

    def fill(self) -> None:
        started = time.perf_counter()
        assert self.full.acquire(queue_key(0), message_id(0), ttl=TTL, limit=1, lock="until_executed").acquired
        self.conn.execute(FILL, {**self.numbers(0), "every": 1})
        filled = time.perf_counter() - started
        for i in (1, self.locks // 2, self.locks - 1):
            info = self.full.inspect(queue_key(i))
            assert info is not None and info.lock == "until_executed" and list(info.holders) == [message_id(i)], info
        refused = self.full.acquire(queue_key(1), "intruder", ttl=TTL, limit=1, lock="until_executed")
        assert not refused.acquired and refused.holder == message_id(1), refused
        self.conn.execute(f"VACUUM ANALYZE {sql.LOCKS}")
        sizes = self.sizes()
        self.figures["fill"] = {"rows": self.locks, "seconds": filled, **sizes}
        print(f"fill: {self.locks:,} until_executed locks (ttl 1 h) in {filled:.1f} s (one taken through the backend, "
              f"copied by INSERT ... SELECT; 3 read back); then VACUUM ANALYZE")
        print(f"  size: {mb(sizes['total'])} total = {mb(sizes['table'])} table + {mb(sizes['indexes'])} indexes"
              f" (+ free space map and visibility map)")

    def per_job(self) -> None:
        times: dict[str, list[float]] = {"empty": [], "full": []}
        ratios = []
        for backend in (self.empty, self.full):
            for _ in range(20):
                fresh_pair(backend)
        tables = (("empty", self.empty, self.empty_conn), ("full", self.full, self.conn))
        for _ in range(max(self.pairs // CHUNK, 1)):
            chunks: dict[str, list[float]] = {"empty": [], "full": []}
            for _ in range(CHUNK):
                for name, backend, _ in tables:
                    chunks[name].append(fresh_pair(backend))
            for name, _, conn in tables:
                times[name] += chunks[name]
                conn.execute(JOBS_DELETE)
            ratios.append(statistics.median(chunks["full"]) / statistics.median(chunks["empty"]))
        figure = {name: {"median": statistics.median(t), "p95": p95(t), "pairs": len(t)} for name, t in times.items()}
        ratio = figure["full"]["median"] / figure["empty"]["median"]
        self.figures["per_job"] = {**figure, "ratio": ratio, "chunk_ratios": [min(ratios), max(ratios)]}
        print(f"per job: run-lock start + release on a fresh key, 1 thread, synchronous_commit as the server, "
              f"{len(times['full']):,} pairs per table, taken in turn, in chunks of {CHUNK}")
        for name in ("empty", "full"):
            print(f"  {name:5} table: median {figure[name]['median']:.3f} ms, p95 {figure[name]['p95']:.3f} ms")
        print(f"  full / empty: {ratio:.3f} (chunks {min(ratios):.2f} to {max(ratios):.2f}; target <= 1.2)")

    def sweep(self) -> None:
        plan = self.conn.execute("EXPLAIN (FORMAT JSON) " + sql.SWEEP, [self.full.sweep_batch]).fetchone()
        found = self.conn.execute(EXPIRE, self.numbers(0)).rowcount
        started = time.perf_counter()
        deleted = self.full.sweep()
        ms = (time.perf_counter() - started) * 1000
        self.conn.execute(FILL, self.numbers(0))
        during: list[float] = []
        after: list[float] = []
        sweeps: list[Optional[int]] = []
        sweeper = PostgresBackend(url=self.full_url, sweep_interval=NEVER)
        waits = Waits(self.full_url)
        waits.start()
        for phase in range(1, SWEEP_ROUNDS + 1):
            self.conn.execute(EXPIRE, self.numbers(phase))
            thread = threading.Thread(target=lambda: sweeps.append(sweeper.sweep()))
            waits.phase = "during"
            thread.start()
            while thread.is_alive():
                during.append(fresh_pair(self.full))
            waits.phase = ""
            thread.join()
            self.conn.execute(FILL, self.numbers(phase))
            waits.phase = "without"
            after += [fresh_pair(self.full) for _ in range(max(len(during) - len(after), 1))]
            waits.phase = ""
        waits.done.set()
        sweeper.close()
        # The backend's own: a call that finds a sweep due starts it on a thread and returns.
        due = PostgresBackend(url=self.full_url, sweep_interval=1000)
        fresh_pair(due)
        triggers, threads, left = [], 0, 0
        for _ in range(3):
            self.conn.execute(EXPIRE, self.numbers(SWEEP_ROUNDS + 1))
            time.sleep(1.1)
            triggers.append(fresh_pair(due))
            running = [t for t in threading.enumerate() if t.name == "dramatiq-unique-sweep"]
            threads += bool(running)
            for thread in running:
                thread.join()
            row = self.conn.execute(f"SELECT count(*) FROM {sql.LOCKS} WHERE expires_at < now()").fetchone()
            left += row[0] if row else 0
            self.conn.execute(FILL, self.numbers(SWEEP_ROUNDS + 1))
        due.close()
        self.conn.execute(JOBS_DELETE)
        scans = sorted(set(scans_of(plan[0][0]["Plan"]))) if plan else []
        bound = DEFAULT_SWEEP_BATCHES * self.full.sweep_batch
        self.figures["sweep"] = {
            "expired": found, "deleted": deleted, "ms": ms, "scans": scans, "bound_rows": bound,
            "during": {"median": statistics.median(during), "p95": p95(during), "pairs": len(during)},
            "without": {"median": statistics.median(after), "p95": p95(after), "pairs": len(after)},
            "waits": {phase: dict(seen) for phase, seen in waits.seen.items()},
            "sweeps_during": sweeps, "trigger_ms": triggers, "trigger_threads_running": threads,
            "left_after_triggered_sweeps": left}
        print(f"sweep: {found:,} of {self.locks:,} rows expired, spread over the table; one sweep() deleted "
              f"{deleted:,} in {ms:.0f} ms (transactions of at most {self.full.sweep_batch}; at most {bound:,} rows "
              f"a sweep; the table read by: {', '.join(scans)})")
        print(f"  pairs while a sweep runs on another thread: median {statistics.median(during):.3f} ms, "
              f"p95 {p95(during):.3f} ({len(during)} pairs, {SWEEP_ROUNDS} sweeps of "
              f"{sum(s or 0 for s in sweeps):,} rows)")
        print(f"  pairs without a sweep:                    median {statistics.median(after):.3f} ms, "
              f"p95 {p95(after):.3f} ({len(after)} pairs)")
        for when in ("during", "without"):
            print(f"  the pairs' server sessions, sampled every 5 ms, {when} a sweep: {waits.of(when)}")
        print(f"  the pair whose call found a sweep due (3 times, {self.expired:,} rows expired): "
              f"{', '.join(f'{t:.3f}' for t in triggers)} ms; the sweep still ran on its own thread after "
              f"{threads} of them; expired rows left after it: {left}")

    def cycles(self, cycles: int, threads: int) -> None:
        backend = PostgresBackend(url=self.full_url, synchronous_commit="off", max_size=threads + 2)
        done, ends, errors = [0] * threads, [0.0] * threads, []

        def run(n: int) -> None:
            keys = [f"bench:cycle:{{{d}}}:run" for d in range(n, DIGESTS, threads)]
            try:
                for c in range(cycles // threads + (n < cycles % threads)):
                    pair(backend, keys[c % len(keys)])
                    done[n] += 1
            except Exception as e:  # raised again below
                errors.append(e)
            ends[n] = time.monotonic()

        print(f"cycles: {cycles:,} run-lock start + release on {threads} threads over {DIGESTS:,} keys, "
              f"synchronous_commit off in the backend's transactions, the backend's own sweeps "
              f"(every {backend.sweep_interval // 1000} s)")
        print(f"  {'cycles':>9} {'s':>6} {'pairs/s':>7} {'total':>8} {'table':>8} {'indexes':>8} {'live':>8} "
              f"{'dead':>7} {'HOT %':>5} {'autovac':>7} {'last':>6} {'unexpired':>9}")
        samples = [self.sample(0, 0.0, None)]
        started, every, mark = time.monotonic(), max(cycles // 10, 1), max(cycles // 10, 1)
        workers = [threading.Thread(target=run, args=(n,)) for n in range(threads)]
        for worker in workers:
            worker.start()
        while any(worker.is_alive() for worker in workers):
            time.sleep(0.2)
            if sum(done) >= mark:
                samples.append(self.sample(sum(done), time.monotonic() - started, samples[-1]))
                mark = (sum(done) // every + 1) * every
        backend.close()
        if errors:
            raise errors[0]
        if samples[-1]["cycles"] < sum(done):
            samples.append(self.sample(sum(done), max(ends) - started, samples[-1]))
        self.figures["cycles"] = {"threads": threads, "keys": DIGESTS, "synchronous_commit": "off", "samples": samples}

    def sample(self, cycles: int, elapsed: float, before: Optional[dict[str, Any]]) -> dict[str, Any]:
        """The table's size and statistics after ``cycles``; ``before``, the last sample."""
        rate = (cycles - before["cycles"]) / (elapsed - before["elapsed"]) if before else 0.0
        time.sleep(1.1)  # the sessions' statistics reach pg_stat_user_tables about once a second
        s = {"cycles": cycles, "elapsed": elapsed, "pairs_per_s": rate, **self.sizes()}
        hot = 100 * s["n_tup_hot_upd"] / s["n_tup_upd"] if s["n_tup_upd"] else 0.0
        last = "-" if s["last_autovacuum_s_ago"] is None else f"{s['last_autovacuum_s_ago']}s"
        print(f"  {cycles:>9,} {elapsed:>6.0f} {rate:>7.0f} {mb(s['total']):>8} {mb(s['table']):>8} "
              f"{mb(s['indexes']):>8} {s['n_live_tup']:>8,} {s['n_dead_tup']:>7,} {hot:>5.1f} "
              f"{s['autovacuum_count']:>7} {last:>6} {s['unexpired']:>9,}", flush=True)
        return s


class Waits(threading.Thread):
    """What the timed pairs' server sessions wait on, sampled from
    ``pg_stat_activity`` every 5 ms while ``phase`` names one.
    """

    QUERY = ("SELECT coalesce(wait_event_type || ':' || wait_event, 'running') FROM pg_stat_activity "
             "WHERE application_name = %s AND state = 'active'")

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.phase, self.done = url, "", threading.Event()
        self.seen: dict[str, Counter[str]] = {"during": Counter(), "without": Counter()}

    def run(self) -> None:
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self.done.wait(0.005):
                if self.phase:
                    self.seen[self.phase].update(event for (event,) in conn.execute(self.QUERY, [PAIRS_SESSION]))

    def of(self, phase: str) -> str:
        return ", ".join(f"{event} {n}" for event, n in self.seen[phase].most_common()) or "no sample"


def scans_of(plan: dict[str, Any]) -> list[str]:
    """The plan's nodes that read the lock table."""
    mine = [plan["Node Type"]] if plan.get("Relation Name") == sql.LOCKS and "Scan" in plan["Node Type"] else []
    return mine + [scan for child in plan.get("Plans", []) for scan in scans_of(child)]


def mb(size: int) -> str:
    return f"{size / 2**20:.1f} MB"


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pg_scale", description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a PostgreSQL server on which to make two databases (default: a private one)")
    parser.add_argument("--locks", type=int, default=100_000)
    parser.add_argument("--cycles", type=int, default=1_000_000)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=PAIRS, help="pairs per table for the per-job cost")
    parser.add_argument("--output", help="write the figures as JSON to this path")
    args = parser.parse_args(argv)
    server = None if args.url else PrivatePostgres().start()
    url = args.url or server.url  # type: ignore[union-attr]
    try:
        scale = Scale(url, args.locks, args.pairs)
        try:
            print(f"{version(scale.full_url)}; {os.cpu_count()} cores, load average "
                  f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
            for step in (scale.fill, scale.per_job, scale.sweep):
                step()
                print(flush=True)
            if args.cycles:
                scale.cycles(args.cycles, args.threads)
            print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
            if args.output:
                with open(args.output, "w") as out:
                    json.dump(scale.figures, out, indent=2)
        finally:
            scale.close()
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
