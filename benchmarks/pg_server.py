"""The PostgreSQL of ``python -m benchmarks --postgres``: a private
cluster the harness starts (``fsync`` on, as a server in production
runs, so that ``synchronous_commit`` costs what it costs there), or a
server given by URL; the connection string of each ``synchronous_commit``
setting; and the rows each run leaves.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

from .server import BenchmarkError, free_port

#: Where Debian's packages put the server's programs.
_DEBIAN_BIN = sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)

#: The floor's table: one row per job, written once.
FLOOR_TABLE = "bench_floor_writes"

#: What a private cluster loads beyond the defaults: per-statement
#: server times, for the profile of one take and release.
PRELOAD = "pg_stat_statements"


def program(name: str) -> Optional[str]:
    found = shutil.which(name)
    if found:
        return found
    for directory in _DEBIAN_BIN:
        if (directory / name).exists():
            return str(directory / name)
    return None


def with_synchronous_commit(url: str, setting: str) -> str:
    """``url`` as a libpq connection string whose sessions run with
    ``synchronous_commit`` set to ``setting`` (``-c`` in ``options``).
    """
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    options = conninfo_to_dict(url).get("options") or ""
    return make_conninfo(url, options=f"{options} -c synchronous_commit={setting}".strip())


def check_setting(conninfo: str, setting: str) -> None:
    """Raise BenchmarkError unless a session of ``conninfo`` runs with
    ``synchronous_commit`` set to ``setting``.
    """
    import psycopg

    try:
        with psycopg.connect(conninfo, autocommit=True, connect_timeout=5) as conn:
            row = conn.execute("SHOW synchronous_commit").fetchone()
    except psycopg.Error as e:
        raise BenchmarkError(f"PostgreSQL at {conninfo} refused a connection: {e}") from None
    if row is None or row[0] != setting:
        raise BenchmarkError(f"sessions of {conninfo} run with synchronous_commit={row and row[0]}, not {setting}")


def prepare(conninfo: str) -> None:
    """Create the floor's table (the backend creates its own)."""
    import psycopg

    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(f'CREATE TABLE IF NOT EXISTS {FLOOR_TABLE} (key text COLLATE "C" PRIMARY KEY, '
                     "at timestamptz NOT NULL)")


def rows_of(conninfo: str, namespace: str) -> tuple[int, int]:
    """The rows the floor's table and the lock backend's hold under
    ``namespace``, then delete them, so that every round starts on
    tables of the same size.
    """
    import psycopg

    from dramatiq_unique.backends.postgres import sql

    counts = []
    with psycopg.connect(conninfo, autocommit=True) as conn:
        for table in (FLOOR_TABLE, sql.LOCKS):
            if conn.execute("SELECT to_regclass(%s)", [table]).fetchone() == (None,):
                counts.append(0)
                continue
            row = conn.execute(f"WITH gone AS (DELETE FROM {table} WHERE key LIKE %s RETURNING 1) "
                               "SELECT count(*) FROM gone", [f"{namespace}:%"]).fetchone()
            counts.append(int(row[0]) if row else 0)
    return counts[0], counts[1]


def version(conninfo: str) -> str:
    import psycopg

    with psycopg.connect(conninfo, autocommit=True) as conn:
        row = conn.execute("SELECT current_setting('server_version'), current_setting('fsync'), "
                           "current_setting('wal_sync_method')").fetchone()
    assert row is not None
    return f"PostgreSQL {row[0]} (fsync {row[1]}, wal_sync_method {row[2]})"


class PrivatePostgres:
    """A throw-away cluster on a free port, with the server's defaults
    (``fsync`` and ``synchronous_commit`` on): ``initdb`` runs as the
    ``postgres`` user when the harness runs as root, which it refuses.
    """

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self.root: Optional[Path] = None
        self.pg_ctl = program("pg_ctl")

    def _run(self, command: list[str]) -> None:
        prefix = []
        if os.geteuid() == 0:
            try:
                pwd.getpwnam("postgres")
            except KeyError:
                raise BenchmarkError("initdb refuses root, and there is no postgres user: pass a URL.") from None
            prefix = ["runuser", "-u", "postgres", "--"]
        done = subprocess.run(prefix + command, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise BenchmarkError(f"{' '.join(command[:2])} failed: {done.stderr.strip() or done.stdout.strip()}")

    def start(self) -> "PrivatePostgres":
        initdb = program("initdb")
        if initdb is None or self.pg_ctl is None:
            raise BenchmarkError("initdb and pg_ctl are not installed: run `apt-get install postgresql`, "
                                 "or pass --postgres URL.")
        self.root = Path(tempfile.mkdtemp(prefix="dramatiq-unique-bench-pg-"))
        sockets = self.root / "run"
        sockets.mkdir()
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres")
            shutil.chown(sockets, "postgres")
        self._run([initdb, "-D", str(self.root / "data"), "-U", "postgres", "-A", "trust", "--no-sync"])
        options = (f"-p {self.port} -k {sockets} -c listen_addresses=127.0.0.1 "
                   f"-c shared_preload_libraries={PRELOAD}")
        self._run([self.pg_ctl, "-D", str(self.root / "data"), "-o", options, "-l", str(self.root / "log"),
                   "-w", "start"])
        deadline = time.monotonic() + 30
        while not _answers(self.url):
            if time.monotonic() > deadline:
                self.stop()
                raise BenchmarkError(f"PostgreSQL did not start on port {self.port}.")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self.root is None:
            return
        try:
            assert self.pg_ctl is not None
            self._run([self.pg_ctl, "-D", str(self.root / "data"), "-m", "immediate", "-w", "stop"])
        except BenchmarkError:
            pass
        shutil.rmtree(self.root, ignore_errors=True)
        self.root = None


def _answers(url: str) -> bool:
    import psycopg

    try:
        psycopg.connect(url, connect_timeout=1).close()
        return True
    except psycopg.OperationalError:
        return False
