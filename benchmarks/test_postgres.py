"""The ``--postgres`` run end to end on a tiny plan: every contender runs
every job exactly once, the floor writes a row per job and the lock a
row per key in PostgreSQL, with each ``synchronous_commit`` setting, so
that the harness cannot silently measure nothing.

Uses ``REDIS_URL`` and ``DU_TEST_POSTGRES_URL`` when they are
set, else a private ``redis-server`` and a private PostgreSQL.
"""

from __future__ import annotations

import os
from typing import Iterator

import pytest

from tests.conftest import POSTGRES_URL_VARIABLE
from tests.postgres_server import database_on

from . import pg_costs, pg_document
from .app import BARE
from .pg_app import PG_FLOOR, PG_LOCK
from .pg_rounds import CONTENDERS, REDIS_LOCK, SETTINGS, PgPlan, Run, check, measure, table
from .pg_server import PrivatePostgres, check_setting, with_synchronous_commit
from .server import BenchmarkError, PrivateRedis, connect
from .workers import THREADS


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    try:
        server = PrivateRedis().start()
    except BenchmarkError as e:
        pytest.fail(str(e))
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    if os.environ.get(POSTGRES_URL_VARIABLE):
        yield from database_on(os.environ[POSTGRES_URL_VARIABLE])
        return
    try:
        server = PrivatePostgres().start()
    except BenchmarkError as e:
        pytest.fail(str(e))
    yield server.url
    server.stop()


def test_each_contender_runs_every_job_once_and_writes_to_postgres(redis_url: str, postgres_url: str) -> None:
    # Given a plan of one round of a few jobs
    plan = PgPlan(sent=40, rounds=1, chunk=10, calls=0)
    # When the run measures every contender with each setting
    results = measure(connect(redis_url), redis_url, postgres_url, plan)
    # Then every contender ran every job once, and did its work in PostgreSQL
    assert results.violations == []
    for setting in SETTINGS:
        for contender in CONTENDERS:
            [run] = results.runs[(setting, contender)]
            assert run.exactly_once and run.rate > 0
            assert run.floor_rows == (40 if contender == PG_FLOOR else 0)
            assert run.lock_rows == (40 if contender == PG_LOCK else 0)
            if contender in (REDIS_LOCK, PG_LOCK):
                assert run.events["locked"] == 40 and 40 - THREADS <= run.events["released"] <= 40
    assert "÷ PostgreSQL floor" in table(results)


def test_the_profile_times_every_call_and_reads_the_plans_of_the_backends_writes(postgres_url: str) -> None:
    costs, plans = pg_costs.profile(postgres_url, "off", calls=20, chunk=10)
    assert {cost.name for cost in costs} >= {"take (`start`)", "release", "rules of a release, in memory"}
    assert all(cost.wall > 0 and cost.cpu >= 0 for cost in costs)
    assert set(plans) == {"write", "delete"} and all("Scan" in plan for plan in plans.values())


def test_each_setting_reaches_the_sessions(postgres_url: str) -> None:
    for setting in SETTINGS:
        check_setting(with_synchronous_commit(postgres_url, setting), setting)
    with pytest.raises(BenchmarkError, match="synchronous_commit=on, not off"):
        check_setting(with_synchronous_commit(postgres_url, "on"), "off")


def _run(*, exactly_once: bool = True, floor_rows: int = 0, lock_rows: int = 0, locked: int = 0) -> Run:
    return Run(100.0, exactly_once, None, floor_rows, lock_rows, {"locked": locked, "released": locked})


@pytest.mark.parametrize(
    "contender, run, broken",
    [
        (BARE, _run(), False),
        (BARE, _run(exactly_once=False), True),
        (PG_FLOOR, _run(floor_rows=10), False),
        (PG_FLOOR, _run(floor_rows=0), True),  # a floor that wrote nothing
        (PG_LOCK, _run(lock_rows=10, locked=10), False),
        (PG_LOCK, _run(lock_rows=0, locked=10), True),  # locks that never reached PostgreSQL
        (PG_LOCK, _run(lock_rows=10, locked=0), True),  # a lock that was never taken
        (PG_LOCK, _run(lock_rows=10, locked=11), True),  # a lock taken twice
        (REDIS_LOCK, _run(locked=10), False),
        (REDIS_LOCK, _run(lock_rows=10, locked=10), True),  # the Redis lock wrote to PostgreSQL
    ],
)
def test_a_run_that_did_not_do_its_work_is_caught(contender: str, run: Run, broken: bool) -> None:
    assert (check(contender, 10, run) is not None) == broken


def test_the_postgres_section_is_replaced_by_its_run_and_kept_by_the_others() -> None:
    first = f"{pg_document.BEGIN}\n## Locks in PostgreSQL\n\nold figures\n{pg_document.END}"
    second = first.replace("old figures", "new figures")
    # The --postgres run appends its section, then replaces it, and only it
    page = pg_document.splice("# Performance\n\nRedis tables\n", first)
    assert page.startswith("# Performance\n\nRedis tables\n") and page.count(pg_document.BEGIN) == 1
    page = pg_document.splice(page, second)
    assert "new figures" in page and "old figures" not in page and "Redis tables" in page
    # The full run rewrites the page and keeps the section
    rewritten = pg_document.keep("# Performance\n\nnew Redis tables\n", page)
    assert "new Redis tables" in rewritten and "new figures" in rewritten and "\nRedis tables" not in rewritten
    assert pg_document.keep("# Performance\n", "# Performance\n") == "# Performance\n"
