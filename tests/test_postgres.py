"""PostgresBackend on a real PostgreSQL: its stored state, its schema,
its sweep, bad input, PgBouncer in transaction mode, and renewal from
a native thread under gevent.  The backend contract and the model run
on it in tests/test_backends.py and tests/test_properties.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid
from typing import Iterator

import psycopg
import psycopg_pool
import pytest

from dramatiq_unique import StubBackend
from dramatiq_unique.backends.records import Copy, CopyVerdict, EnqueueRecord
from dramatiq_unique.backends.postgres import PostgresBackend, sql
from dramatiq_unique.backends.postgres.state import dump, load
from dramatiq_unique.errors import ConfigurationError, LockBackendError
from tests.conftest import free_port
from tests.postgres_server import PgBouncer, PostgresServer, database_on, empty, with_database

KEY = "t:actor:{abc}:run"
QUEUE_KEY = "t:actor:{abc}:queue"
RUN_KEY = "t:other:{def}:run"


def rows(backend: PostgresBackend) -> dict[str, dict]:
    with backend._connection() as conn:
        return {key: state for key, state in conn.execute(f"SELECT key, state FROM {sql.LOCKS}").fetchall()}


# The stored state -----------------------------------------------------------


def busy_stub() -> StubBackend:
    """A stub whose keys hold every kind of state the stub keeps."""
    stub = StubBackend()
    stub.acquire(QUEUE_KEY, "m1", ttl=60_000, lock="until_executed", lock_args='{"a":1}', provisional=5_000,
                 where="ns\tq\tid")
    stub.acquire(KEY, "holder/1", ttl=60_000, limit=2, lock="while_executing")
    stub.join_line(Copy(KEY, "m2", 1, "handoff"), b"\x00\xffbody", order=7, ttl=60_000)
    stub.join_line(Copy(KEY, "m3", 1, "handoff"), b"other", order=8, ttl=60_000)
    stub.start(KEY, "m2/1", ttl=60_000, limit=2, lock="while_executing", copy=Copy(KEY, "m2", 1, "delay", retries=1))
    stub.claim(Copy(KEY, "m3", 1, "delay"))
    # a run that succeeded finishes its message's record
    stub.join_line(Copy(RUN_KEY, "m4", 1, "handoff"), b"m4", order=9, ttl=60_000)
    stub.start(RUN_KEY, "m4/1", ttl=60_000, limit=1, lock="while_executing", copy=Copy(RUN_KEY, "m4", 1, "delay"))
    stub.release(RUN_KEY, "m4/1", succeeded=True)
    replace_key = "t:newest:{x}:queue"
    stub.replace(replace_key, "r1", ttl=60_000, superseded_ttl=60_000, where="w1", debounce=100)
    stub.replace(replace_key, "r2", ttl=60_000, superseded_ttl=60_000, where="w2")
    return stub


def parts(stub: StubBackend, key: str) -> tuple:
    return stub.key_state(key)[:4]


def test_every_part_of_a_keys_state_survives_the_round_trip_through_json() -> None:
    stub = busy_stub()
    for key in (KEY, QUEUE_KEY, RUN_KEY, "t:newest:{x}:queue"):
        dumped = dump(stub, key)
        assert dumped.expires_at > 0
        again = StubBackend()
        load(again, key, json.loads(json.dumps(dumped.state)))
        assert parts(again, key) == parts(stub, key)
        assert dump(again, key) == dumped
    # what the busy stub holds is there to check: records with a run, a finish and bytes
    assert stub._records[(KEY, "m2")].runner == "m2/1" and stub._records[(RUN_KEY, "m4")].finished is not None
    assert dump(stub, KEY).state["entry"]["holders"].keys() == {"holder/1", "m2/1"}


def test_the_stub_keeps_no_state_that_is_not_stored() -> None:
    # A new attribute of StubBackend is state that PostgresBackend would lose: add it to KeyState.
    # (The clock is no state: PostgresBackend gives the rules its server's for each call.)
    assert set(vars(busy_stub())) == {
        "clock", "_mutex", "_entries", "_waiters", "_superseded", "_records", "_last_fence"
    }


def test_a_key_that_holds_nothing_keeps_only_its_fence(postgres_backend: PostgresBackend) -> None:
    fence = postgres_backend.acquire(KEY, "a", ttl=10_000).fence
    assert postgres_backend.release(KEY, "a").held
    assert rows(postgres_backend) == {KEY: {"fence": fence}}
    assert postgres_backend.acquire(KEY, "b", ttl=10_000).fence > fence
    # a call that finds nothing leaves no row
    assert not postgres_backend.release("t:other:{x}:run", "nobody").held
    assert set(rows(postgres_backend)) == {KEY}


def test_deadlines_follow_the_servers_clock(postgres_backend: PostgresBackend) -> None:
    with postgres_backend._connection() as conn:
        before = conn.execute("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint").fetchone()[0]
    postgres_backend.acquire(KEY, "a", ttl=10_000)
    deadline = postgres_backend.inspect(KEY).holders["a"]
    assert before + 10_000 <= deadline < before + 10_000 + 5_000


def test_the_statement_timeout_bounds_a_call_that_waits_for_a_locked_row(postgres_url: str) -> None:
    """The timeout is set in the same message as the row locks: it must
    cover them, or a call behind a stuck transaction waits for it.
    """
    backend = PostgresBackend(url=postgres_url, statement_timeout=300)
    backend.acquire(KEY, "a", ttl=60_000)
    with psycopg.connect(postgres_url, autocommit=True) as blocker:
        blocker.execute("SET statement_timeout = 5000")
        with blocker.transaction():
            blocker.execute(f"SELECT 1 FROM {sql.LOCKS} WHERE key = %s FOR UPDATE", [KEY])
            # the blocker lets go after 4 s at the latest: without the timeout, the call returns then
            letting_go = threading.Timer(4.0, blocker.close)
            letting_go.start()
            started = time.monotonic()
            try:
                with pytest.raises(psycopg.errors.QueryCanceled):
                    backend.release(KEY, "a")
            finally:
                letting_go.cancel()
            waited = time.monotonic() - started
    assert 0.25 < waited < 3.0
    assert backend.release(KEY, "a").held  # the canceled call changed nothing
    backend.close()


# Mutual exclusion under contention -------------------------------------------


def test_contending_threads_never_hold_a_limited_key_together(postgres_backend: PostgresBackend) -> None:
    holding: list[str] = []
    overlaps: list[list[str]] = []
    taken = []
    guard = threading.Lock()

    def contend(name: str) -> None:
        for i in range(30):
            owner = f"{name}-{i}"
            if postgres_backend.acquire(KEY, owner, ttl=10_000, limit=2).acquired:
                with guard:
                    holding.append(owner)
                    taken.append(owner)
                    if len(holding) > 2:
                        overlaps.append(list(holding))
                time.sleep(0.001)
                with guard:
                    holding.remove(owner)
                assert postgres_backend.release(KEY, owner).held

    threads = [threading.Thread(target=contend, args=(f"t{n}",)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert overlaps == [] and len(taken) >= 30


# Schema -------------------------------------------------------------------


@pytest.fixture
def fresh_database(postgres_url: str) -> Iterator[str]:
    """A database of its own, without the backend's table."""
    yield from database_on(with_database(postgres_url, "postgres"))


def test_the_schema_is_made_once_when_processes_start_together(fresh_database: str) -> None:
    backends = [PostgresBackend(url=fresh_database) for _ in range(6)]
    errors: list[BaseException] = []

    def first_call(backend: PostgresBackend, n: int) -> None:
        try:
            backend.acquire(f"t:{n}:{{k}}:run", "a", ttl=10_000)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=first_call, args=(b, n)) for n, b in enumerate(backends)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(list(backends[0].scan("t:*"))) == 6
    for backend in backends:
        backend.close()


def test_a_database_that_refuses_the_schema_gets_a_clear_error(fresh_database: str) -> None:
    role = f"du_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(fresh_database, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN")
        conn.execute(f"REVOKE CREATE ON SCHEMA public FROM PUBLIC, {role}")
    try:
        url = fresh_database.replace("//postgres@", f"//{role}@")
        assert url != fresh_database
        backend = PostgresBackend(url=url)
        with pytest.raises(LockBackendError, match=rf"refused to create the table {sql.LOCKS}.*permission denied"):
            backend.acquire(KEY, "a", ttl=1_000)
        with psycopg.connect(fresh_database) as conn:
            assert conn.execute(sql.EXISTS).fetchone() == (None,)  # nothing half-made
        backend.close()
    finally:
        with psycopg.connect(fresh_database, autocommit=True) as conn:
            conn.execute(f"DROP OWNED BY {role}")
            conn.execute(f"DROP ROLE {role}")


def test_without_create_schema_a_missing_table_is_named(fresh_database: str) -> None:
    backend = PostgresBackend(url=fresh_database, create_schema=False)
    with pytest.raises(LockBackendError, match=f"has no table {sql.LOCKS}.*create_schema"):
        backend.acquire(KEY, "a", ttl=1_000)
    backend.create_schema()
    assert backend.acquire(KEY, "a", ttl=1_000).acquired
    backend.close()


# Bad input ---------------------------------------------------------------------


def test_min_replicas_is_refused_with_the_servers_setting_named() -> None:
    with pytest.raises(ConfigurationError, match="synchronous_standby_names"):
        PostgresBackend.from_url("postgresql://127.0.0.1/db", min_replicas=1)


def test_a_host_that_does_not_resolve_is_made_and_named_when_called() -> None:
    # A name may not be in DNS yet when a worker starts: as with Redis, the
    # backend is made, and its calls fail naming the host (the boot check
    # logs that, tests/test_first_day.py).
    backend = PostgresBackend.from_url("postgres://user:secret@no-such-host.invalid:5432/db", timeout=1)
    try:
        assert "secret" not in backend.describe() and "no-such-host.invalid" in backend.describe()
        with pytest.raises(Exception, match="no-such-host.invalid"):
            backend.check("p:!check")
    finally:
        backend.close()


def test_a_url_that_does_not_parse_is_refused_with_it_named() -> None:
    with pytest.raises(ConfigurationError, match="cannot parse the URL"):
        PostgresBackend.from_url("postgresql://db/app?nosuchparam=1")


def test_without_psycopg_the_error_names_the_extra() -> None:
    code = ("import sys; sys.modules['psycopg'] = None\n"
            "from dramatiq_unique.backends.postgres import PostgresBackend")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "pip install 'dramatiq-unique[postgres]'" in done.stderr


def test_a_server_that_is_down_fails_calls_quickly() -> None:
    backend = PostgresBackend(url=f"postgresql://postgres@127.0.0.1:{free_port()}/db", timeout=1.0)
    started = time.monotonic()
    with pytest.raises((psycopg.OperationalError, psycopg_pool.PoolTimeout)):
        backend.acquire(KEY, "a", ttl=1_000)
    assert time.monotonic() - started < 10
    assert "secret" not in backend.describe()
    backend.close()



def test_after_a_restart_calls_come_back_at_once_not_at_the_pools_backoff() -> None:
    # Given a backend on a PostgreSQL of its own, used once
    server = PostgresServer(free_port())
    server.start()
    backend = PostgresBackend(url=server.url, timeout=1.0)
    try:
        backend.acquire(KEY, "a", ttl=60_000)
        # When the server stops: the first call waits out the pool's timeout,
        # and the calls after it fail at once instead
        server.stop("immediate")
        with pytest.raises(psycopg.OperationalError):
            backend.release(KEY, "a")
        for _ in range(3):
            started = time.monotonic()
            with pytest.raises(psycopg.OperationalError):
                backend.release(KEY, "a")
            assert time.monotonic() - started < 0.5
        # Then, once it is back (the pool's own backoff is at 4 s and more by now),
        # the next call is answered
        time.sleep(4)  # the outage: long enough for the pool's backoff to grow past it
        server.start()
        started = time.monotonic()
        assert backend.release(KEY, "a").held
        assert time.monotonic() - started < 1.0
        assert backend.inspect(KEY) is None
    finally:
        backend.close()
        server.remove()


# The sweep -----------------------------------------------------------------------


def test_the_sweep_deletes_expired_rows_one_process_at_a_time(postgres_backend: PostgresBackend) -> None:
    for n in range(12):
        postgres_backend.acquire(f"t:{n}:{{k}}:run", "a", ttl=1)
    postgres_backend.acquire(KEY, "live", ttl=60_000)
    time.sleep(0.05)
    # another process sweeping: this one does not
    with postgres_backend._connection() as conn, conn.transaction():
        conn.execute(f"SELECT pg_advisory_xact_lock({sql.SWEEP_LOCK})")
        assert postgres_backend.sweep() is None
    postgres_backend.sweep_batch = 5
    assert postgres_backend.sweep() == 12
    assert set(rows(postgres_backend)) == {KEY}
    assert postgres_backend.inspect(KEY).holders.keys() == {"live"}



def test_no_lock_call_waits_for_a_sweep(postgres_url: str) -> None:
    # Given a backend whose sweep is due at every call, and is held up
    entered, go_on = threading.Event(), threading.Event()

    class HeldSweep(PostgresBackend):
        def sweep(self, **options):
            entered.set()
            go_on.wait(30)
            return super().sweep(**options)

    backend = HeldSweep(url=postgres_url, sweep_interval=0)
    try:
        backend.acquire("t:gone:{k}:run", "a", ttl=1)
        # When lock calls run while the sweep they started is held
        assert entered.wait(10)
        assert backend.acquire(KEY, "live", ttl=60_000).acquired
        assert backend.release(KEY, "live").held
        # Then they returned; and once the sweep goes on, the expired row is deleted
        go_on.set()
        deadline = time.monotonic() + 10
        while "t:gone:{k}:run" in rows(backend) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "t:gone:{k}:run" not in rows(backend)
    finally:
        go_on.set()
        empty(backend)
        backend.close()


# PgBouncer in transaction mode ------------------------------------------------------


@pytest.fixture
def bounced(postgres_url: str, postgres_backend: PostgresBackend) -> Iterator[PostgresBackend]:
    """A PostgresBackend through a private pgbouncer (pool_mode=transaction)."""
    from psycopg.conninfo import conninfo_to_dict

    params = conninfo_to_dict(postgres_url)
    bouncer = PgBouncer(free_port(), server_port=int(params["port"]), dbname=str(params["dbname"]))
    backend = PostgresBackend(url=bouncer.url, max_size=8)
    try:
        yield backend
    finally:
        backend.close()
        bouncer.stop()


def test_take_release_and_hand_off_through_pgbouncer_in_transaction_mode(bounced: PostgresBackend) -> None:
    with bounced._connection() as conn:  # through the bouncer, to the server behind it
        assert conn.execute("SELECT inet_server_port()").fetchone()[0] != conn.info.port
    assert bounced.acquire(KEY, "a", ttl=10_000).acquired
    assert not bounced.acquire(KEY, "b", ttl=10_000).acquired
    bounced.join_line(Copy(KEY, "m", 1, "handoff"), b"m", order=1, ttl=10_000)
    assert bounced.extend([(KEY, "a")], 10_000) == [True]
    released = bounced.release(KEY, "a")
    assert released.held and released.promoted == b"m"
    started = bounced.start(KEY, "m/1", ttl=10_000, limit=1, lock="x", copy=Copy(KEY, "m", 1, "handoff"),
                            queue_key=QUEUE_KEY)
    assert started.acquisition.acquired
    assert bounced.start(KEY, "m/2", ttl=10_000, limit=1, lock="x",
                         copy=Copy(KEY, "m", 1, "delay")).acquisition.refused is CopyVerdict.LOST
    assert bounced.release(KEY, "m/1").held
    assert bounced.sweep() is not None  # its advisory lock lives in the transaction only


def test_contending_threads_through_pgbouncer_keep_mutual_exclusion(bounced: PostgresBackend) -> None:
    holding, overlaps, taken, guard = [], [], [], threading.Lock()

    def contend(name: str) -> None:
        for i in range(20):
            owner = f"{name}-{i}"
            if bounced.acquire(KEY, owner, ttl=10_000).acquired:
                with guard:
                    holding.append(owner)
                    taken.append(owner)
                    if len(holding) > 1:
                        overlaps.append(list(holding))
                with guard:
                    holding.remove(owner)
                assert bounced.release(KEY, owner).held

    threads = [threading.Thread(target=contend, args=(f"t{n}",)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert overlaps == [] and taken


# Renewal from a native thread under gevent ---------------------------------------------

GEVENT_RENEWAL = """
from gevent import monkey; monkey.patch_all()
import json, sys, time
from gevent._compat import thread_mod_name
from gevent.monkey import get_original
from dramatiq_unique.backends.postgres import PostgresBackend

backend = PostgresBackend(url=sys.argv[1])
key = "t:gevent:{k}:run"
backend.acquire(key, "holder", ttl=600)
extend = backend.native_extender()
renewals = []

def keep():
    until = time.monotonic() + 2.0
    while time.monotonic() < until:
        renewals.append(extend([(key, "holder")], 600, timeout=500))
        get_original("time", "sleep")(0.1)

get_original(thread_mod_name, "start_new_thread")(keep, ())
until = time.monotonic() + 2.2
while time.monotonic() < until:  # the actor holds the hub: no greenlet runs
    pass
extend.close()
print(json.dumps({"renewals": renewals, "held": list(backend.inspect(key).holders)}))
"""


def test_a_native_extender_renews_while_an_actor_holds_the_hub(postgres_backend: PostgresBackend,
                                                               postgres_url: str) -> None:
    done = subprocess.run([sys.executable, "-c", GEVENT_RENEWAL, postgres_url], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    # renewed all along (a lease of 0.6 s would have lapsed three times over), and still held
    assert len(report["renewals"]) >= 8 and all(r == [True] for r in report["renewals"])
    assert report["held"] == ["holder"]


def test_reap_checks_the_record(postgres_backend: PostgresBackend) -> None:
    postgres_backend.acquire(QUEUE_KEY, "m", ttl=10_000, where="ns\tq\tid")
    record = postgres_backend.inspect(QUEUE_KEY).records["m"]
    assert not postgres_backend.reap(QUEUE_KEY, "m", EnqueueRecord(1, 0, "elsewhere"))
    assert postgres_backend.reap(QUEUE_KEY, "m", record)
    assert postgres_backend.inspect(QUEUE_KEY) is None


def test_the_first_call_after_a_server_restart_finds_a_live_connection() -> None:
    from tests.postgres_server import PostgresServer

    server = PostgresServer(free_port())
    server.start()
    try:
        backend = PostgresBackend(url=server.url)
        done = []

        def hold(n: int) -> None:  # several connections in the pool at once
            done.append(backend.acquire(f"t:{n}:{{k}}:run", "a", ttl=60_000).acquired)

        threads = [threading.Thread(target=hold, args=(n,)) for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert done == [True] * 4
        server.stop("fast")
        server.start()
        # the pool's idle connections all died with the server: the call is sent again on a new one
        assert backend.release("t:0:{k}:run", "a").held
        assert backend.acquire("t:0:{k}:run", "b", ttl=60_000).acquired
        backend.close()
    finally:
        server.remove()


def test_scan_takes_a_glob_and_escapes_what_like_would_read(postgres_backend: PostgresBackend) -> None:
    for key in ("a_b:1:run", "aXb:1:run", "a%b:2:run", "a_b:2:queue"):
        postgres_backend.acquire(key, "o", ttl=10_000)
    assert list(postgres_backend.scan("a_b:*")) == ["a_b:1:run", "a_b:2:queue"]
    assert list(postgres_backend.scan("a?b:1:*")) == ["aXb:1:run", "a_b:1:run"]
    assert list(postgres_backend.scan("a%b:*")) == ["a%b:2:run"]
    assert list(postgres_backend.scan("*:queue")) == ["a_b:2:queue"]


def test_the_stub_reads_time_only_through_its_clock() -> None:
    # PostgresBackend sets the server's clock for the stub's rules: a rule that read
    # this process's clock directly would mix two clocks.
    import inspect

    from dramatiq_unique.backends import rules

    lines = [line.strip() for line in inspect.getsource(rules).splitlines() if "mod_time." in line]
    assert len(lines) == 3 and all(line.startswith("return mod_time.") for line in lines), lines
