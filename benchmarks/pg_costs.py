"""Where one take and release of a run lock in PostgreSQL spends its
time, from one thread: the wall time of each call, the thread's CPU in
it (psycopg, JSON and the stub's rules in Python), the rules alone (run
on rows held in memory), the server's execution time of the statements
(``pg_stat_statements``, where the server has it loaded), beside a bare
round trip (``SELECT 1``) and the floor's committed write.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from statistics import median
from typing import Any, Callable, Optional

from dramatiq_unique.backends.records import Copy

from .pg_app import FLOOR_WRITE
from .pg_server import prepare, rows_of, with_synchronous_commit
from .runs import new_namespace

#: The lease a run lock takes, as the middleware's default.
LEASE = 60_000


@dataclass
class Cost:
    """One kind of call, per call, in microseconds."""

    name: str
    wall: float  # median over chunks
    cpu: float  # the calling thread's CPU, median over chunks
    server: Optional[float] = None  # the statements' execution time on the server


def _statements(conn: Any) -> Optional[float]:
    """The server's total execution time of this database's statements
    so far, in µs, or None without ``pg_stat_statements``.
    """
    try:
        row = conn.execute("SELECT coalesce(sum(total_exec_time), 0) FROM pg_stat_statements "
                           "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())").fetchone()
    except Exception:
        return None
    return float(row[0]) * 1000 if row else None


def _stats_available(conn: Any) -> bool:
    try:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        conn.execute("SELECT count(*) FROM pg_stat_statements").fetchone()
        return True
    except Exception:
        return False


def _timed(calls: int, chunk: int, kinds: dict[str, Callable[[int], Any]], stats: Any) -> list[Cost]:
    """Each kind ``calls`` times, in chunks taken in turn."""
    walls: dict[str, list[float]] = {name: [] for name in kinds}
    cpus: dict[str, list[float]] = {name: [] for name in kinds}
    server: dict[str, float] = dict.fromkeys(kinds, 0.0)
    for first in range(0, calls, chunk):
        for name, call in kinds.items():
            count = min(chunk, calls - first)
            before = _statements(stats) if stats is not None else None
            started, cpu = time.perf_counter(), time.thread_time()
            for i in range(first, first + count):
                call(i)
            cpus[name].append((time.thread_time() - cpu) / count * 1e6)
            walls[name].append((time.perf_counter() - started) / count * 1e6)
            after = _statements(stats) if stats is not None else None
            if before is not None and after is not None:
                server[name] += after - before
    return [Cost(name, median(walls[name]), median(cpus[name]),
                 server[name] / calls if stats is not None else None) for name in kinds]


def _rules_cost(backend: Any, conn: Any, namespace: str, calls: int) -> tuple[float, float]:
    """The stub's rules of a start and of a release, run on rows held in
    memory, in µs per call: the Python a call runs between its reads
    and its writes.
    """
    from dramatiq_unique.backends.postgres import sql
    from dramatiq_unique.backends.postgres.state import apply

    key = f"{namespace}:rules:run"
    owner, copy = "m/0", Copy(key, "m")
    clock = str(int(time.time() * 1e6))
    empty = [(key, "{}", clock)]
    backend.start(key, owner, ttl=LEASE, limit=1, lock="while_executing", copy=copy)
    held = [tuple(row) for row in conn.execute(sql.READ, [key]).fetchall() if row[0] is not None]
    backend.release(key, owner)
    held = [(k, state, clock) for k, state, _ in held]
    start = lambda stub: stub.start(key, owner, ttl=LEASE, limit=1, lock="while_executing", copy=copy)  # noqa: E731
    timings = []
    for rows, verb in ((empty, start), (held, lambda stub: stub.release(key, owner))):
        began = time.thread_time()
        for _ in range(calls):
            apply(rows, verb, fence_memory=3_600_000)
        timings.append((time.thread_time() - began) / calls * 1e6)
    return timings[0], timings[1]


def scans(conn: Any, key: str) -> dict[str, str]:
    """How the server plans the backend's write and delete of one held
    key, as the backend sends them (in a transaction that rolls back):
    the node that reads the lock table, and how many rows it holds.
    """
    from dramatiq_unique.backends.postgres import sql

    found = {}
    with conn.transaction(force_rollback=True):
        conn.execute(sql.STATEMENT_TIMEOUT, ["5000"])  # and whatever else the backend sets in its transactions
        rows = conn.execute(f"SELECT count(*) FROM {sql.LOCKS}").fetchone()
        for name, statement, parameters in (
            ("write", sql.WRITE, ["{}", "0", key]),
            ("delete", sql.DELETE, [key]),
        ):
            plan = conn.execute("EXPLAIN (FORMAT JSON) " + statement, parameters).fetchone()[0][0]["Plan"]
            found[name] = f"{_scan_of(plan, sql.LOCKS)} of {rows[0] if rows else '?'} rows"
    return found


def _scan_of(plan: dict[str, Any], table: str) -> str:
    """The plan node that reads ``table``, e.g. ``Seq Scan``."""
    if plan.get("Relation Name") == table and "Scan" in plan.get("Node Type", ""):
        return str(plan["Node Type"])
    for child in plan.get("Plans", []):
        found = _scan_of(child, table)
        if found:
            return found
    return ""


def profile(postgres_url: str, setting: str, calls: int, chunk: int = 50) -> tuple[list[Cost], dict[str, str]]:
    """Time, from one thread, with ``synchronous_commit`` at ``setting``:
    a bare round trip, the floor's write, a take (``start``), a release,
    and the rules of each in memory; and how the server plans the
    backend's write and delete with those keys' rows in the table.
    """
    import psycopg

    from dramatiq_unique.backends.postgres import PostgresBackend

    conninfo = with_synchronous_commit(postgres_url, setting)
    namespace = new_namespace()
    backend = PostgresBackend(url=conninfo)
    conn = psycopg.connect(conninfo, autocommit=True, prepare_threshold=None)
    stats_conn = psycopg.connect(conninfo, autocommit=True)
    stats = stats_conn if _stats_available(stats_conn) else None
    keys = [f"{namespace}:job:{i}:run" for i in range(calls)]
    owners = [f"{uuid.uuid4().hex}/0" for _ in range(calls)]
    take = lambda i: backend.start(keys[i], owners[i], ttl=LEASE, limit=1,  # noqa: E731
                                   lock="while_executing", copy=Copy(keys[i], owners[i]))
    try:
        backend.create_schema()
        prepare(conninfo)
        take_rules, release_rules = _rules_cost(backend, conn, namespace, calls)
        costs = _timed(calls, chunk, {
            "round trip (`SELECT 1`)": lambda i: conn.execute("SELECT 1").fetchone(),
            "floor: one committed row write": lambda i: conn.execute(FLOOR_WRITE, [f"{namespace}:{i}"]),
            "take (`start`)": take,
            "release": lambda i: backend.release(keys[i], owners[i]),
        }, stats)
        costs += [Cost("rules of a take, in memory", take_rules, take_rules),
                  Cost("rules of a release, in memory", release_rules, release_rules)]
        return costs, scans(conn, keys[0])
    finally:
        rows_of(conninfo, namespace)
        backend.close()
        conn.close()
        stats_conn.close()
