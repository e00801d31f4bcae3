"""Waiting costs little however many wait: many waiters of one key
behind a 3 s holder (5 ms jobs, 2 worker processes x 8 threads) run in
send order, each once and rescheduled at most 4 times, and the lock
Redis processes few commands per waiter: a delayed copy that comes back
while its message is still in line changes nothing and comes back
later.  The default run has 200 waiters with a 1 s reschedule delay, so
that their delayed copies come back while they drain (before: out of
order, up to 19 reschedules).  The 1,000-waiter run of issue 29, at the
default 5 s delay, is the soak variant (``--soak``): it also holds the
drain to 2.5 x the work and the commands to half of the 128.8 a waiter
cost before.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter

from typing import Callable, Iterator

import psycopg
import pytest
import redis

from tests.conftest import free_port, wait_for
from tests.faults.harness import Harness, RedisServer
from tests.postgres_server import PostgresServer

JOB_S = 0.005
HOLD_S = 3


def redis_commands(client: redis.Redis) -> tuple[int, int]:
    """Commands the server processed since its stats were reset: the
    clients' own (scripts count once), and every command, the scripts'
    calls included.
    """
    stats = client.info("stats")
    every = sum(int(entry["calls"]) for entry in client.info("commandstats").values())
    return int(stats["total_commands_processed"]), every


def inversions(order: list[int]) -> int:
    """Pairs that ran in the opposite order to their sends (O(n log n))."""
    count, seen = 0, []  # type: ignore[var-annotated]
    for place in reversed(order):
        count += bisect.bisect_left(seen, place)
        bisect.insort(seen, place)
    return count


def postgres_statements(url: str, reset: bool = False) -> tuple[int, int]:
    """Transactions committed on the lock database, and the statements
    the server ran (``pg_stat_statements``), since the last reset.
    """
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        if reset:
            conn.execute("SELECT pg_stat_statements_reset(), pg_stat_reset()")
            return 0, 0
        conn.execute("SELECT pg_stat_clear_snapshot()")
        (commits,) = conn.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
        (statements,) = conn.execute("SELECT coalesce(sum(calls), 0) FROM pg_stat_statements WHERE query NOT LIKE "
                                     "'%pg_stat_%'").fetchone()
    return int(commits), int(statements)


def fan_out(h: Harness, reset: Callable[[], object], counts: Callable[[], tuple[int, int]], waiters: int,
            figure) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """Send ``waiters`` messages of key k behind a 3 s holder; check that
    each ran once, in send order, rescheduled at most 4 times; return
    how long they took to drain after the holder, in units of their
    work, and the lock server's commands (or statements) per waiter,
    which ``reset`` zeroes and ``counts`` reads: calls, then every
    command or statement.
    """
    h.workers(processes=2, threads=8)
    holder = h.app.hold.send("k", seconds=HOLD_S)
    h.started(holder.message_id)
    reset()
    began = time.monotonic()
    sent = [h.app.hold.message("k", seconds=JOB_S) for _ in range(waiters)]
    for message in sent:
        h.app.broker.enqueue(message)
    figure("sent_in_s", round(time.monotonic() - began, 2))
    ids = {message.message_id for message in sent}
    wait_for(lambda: len({r.message_id for r in h.runs()} & ids) == waiters, timeout=60 + waiters * 0.1,
             what="every waiter to run")
    wait_for(lambda: h.queued() == 0, timeout=60, what="every delayed copy to come and go")
    own, every = counts()
    runs = h.runs()
    holder_end = next(r.end for r in runs if r.message_id == holder.message_id)
    last_end = max(r.end or 0 for r in runs if r.message_id in ids)
    drained = last_end - holder_end
    work = waiters * JOB_S
    per_message = Counter(r.message_id for r in runs if r.message_id in ids)
    reschedules = Counter(e["message_id"] for e in h.events("rescheduled") if e["message_id"] in ids)
    first = sorted((r for r in h.starts() if r.message_id in ids), key=lambda r: r.start)
    ran = list(dict.fromkeys(r.message_id for r in first))
    order = [ran.index(m.message_id) for m in sent]
    figure("waiters", waiters)
    figure("drained_after_the_holder_s", round(drained, 2))
    figure("drained_in_work", round(drained / work, 2))
    figure("most_reschedules", max(reschedules.values()))
    figure("reschedules_per_waiter", round(sum(reschedules.values()) / waiters, 2))
    figure("inversions", inversions(order))
    chain = sorted((r for r in runs if r.message_id in ids), key=lambda r: r.start)
    gaps = sorted(b.start - (a.end or a.start) for a, b in zip(chain, chain[1:]))
    figure("median_handoff_ms", round(gaps[len(gaps) // 2] * 1000, 1))
    figure("lock_calls_per_waiter", round(own / waiters, 1))
    figure("lock_commands_per_waiter", round(every / waiters, 1))
    assert set(per_message.values()) == {1}, per_message
    assert order == list(range(waiters))
    assert max(reschedules.values()) <= 4, reschedules.most_common(3)
    return drained / work, every / waiters


def on_redis(lock_server: RedisServer) -> tuple[Callable[[], object], Callable[[], tuple[int, int]]]:
    client = redis.Redis.from_url(lock_server.url)
    return client.config_resetstat, lambda: redis_commands(client)


def on_postgres(url: str) -> tuple[Callable[[], object], Callable[[], tuple[int, int]]]:
    return lambda: postgres_statements(url, reset=True), lambda: postgres_statements(url)


def test_many_waiters_of_one_key_drain_in_order_at_little_cost(make_harness, lock_server, figure):
    # 200 waiters with a 1 s reschedule delay: their delayed copies come back while they drain
    h = make_harness("redis", FAULTS_LOCK_URL=lock_server.url, FAULTS_RESCHEDULE_DELAY="1000",
                     FAULTS_LEASE="10000", FAULTS_EVENTS="rescheduled")
    fan_out(h, *on_redis(lock_server), 200, figure)


@pytest.mark.soak
def test_a_thousand_waiters_of_one_key_drain_in_order_at_little_cost(make_harness, lock_server, figure):
    h = make_harness("redis", FAULTS_LOCK_URL=lock_server.url, FAULTS_RESCHEDULE_DELAY="5000",
                     FAULTS_LEASE="10000", FAULTS_EVENTS="rescheduled")
    drained, per_waiter = fan_out(h, *on_redis(lock_server), 1000, figure)
    # the targets of issue 29: within 2.5 x the work, and half the 128.8 commands a waiter cost before
    assert per_waiter <= 64, per_waiter
    assert drained <= 2.5, drained


@pytest.fixture
def statements_postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL for locks only, counting its statements."""
    server = PostgresServer(free_port(), "shared_preload_libraries=pg_stat_statements")
    server.start()
    with psycopg.connect(server.url, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    yield server
    print((server.root / "log").read_text(errors="replace")[-4000:])  # pytest shows it for a failure
    server.remove()


@pytest.mark.soak
@pytest.mark.parametrize("waiters", [200, 1000])
def test_waiters_of_one_key_drain_in_order_on_postgres(make_harness, statements_postgres, figure, waiters):
    # As on Redis, with the locks in PostgreSQL; the 1,000-waiter line at the default 5 s delay.
    # Not met yet (issue 36): a key's waiters and records live in its one row, so every call on the
    # key reads and writes all of them (1.4 ms a call at 50 waiters, 20 ms at 1,000:
    # benchmarks/pg_line.py), and the line drains in O(n^2).
    delay = "1000" if waiters < 1000 else "5000"
    h = make_harness("redis", FAULTS_LOCK_URL=statements_postgres.url, FAULTS_RESCHEDULE_DELAY=delay,
                     FAULTS_LEASE="10000", FAULTS_EVENTS="rescheduled")
    drained, _ = fan_out(h, *on_postgres(statements_postgres.url), waiters, figure)
    if waiters >= 1000:
        assert drained <= 2.5, drained  # issue 36's target: within 2.5 x the work
