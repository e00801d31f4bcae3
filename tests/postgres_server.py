"""A private PostgreSQL for the suite, and a PgBouncer in front of it.

The server is a throw-away cluster that ``initdb`` makes in a temporary
directory, run as the ``postgres`` user when the suite runs as root
(``initdb`` refuses root), with ``fsync=off``, on a free port.  Set
``DU_TEST_POSTGRES_URL`` to use a server of your own instead: the suite
then makes a database of its own there, and drops it, even when
interrupted; the databases of a session that could not (killed) are
dropped by the next session that uses that server.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional
from urllib.parse import urlsplit, urlunsplit

import pytest

from tests.conftest import session_name, stale

#: Where Debian's packages put the server's programs.
_DEBIAN_BIN = sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)

INSTALL = "apt-get install postgresql (or set DU_TEST_POSTGRES_URL to a server the suite may use)"


def _program(name: str) -> Optional[str]:
    found = shutil.which(name)
    if found:
        return found
    for directory in _DEBIAN_BIN:
        if (directory / name).exists():
            return str(directory / name)
    return None


def _as_owner() -> list[str]:
    """The prefix that runs a command as the cluster's owner."""
    if os.geteuid() != 0:
        return []
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        pytest.fail("initdb refuses to run as root and there is no postgres user: " + INSTALL)
    return ["runuser", "-u", "postgres", "--"]


def _answers(url: str) -> bool:
    import psycopg

    try:
        psycopg.connect(url, connect_timeout=1).close()
        return True
    except psycopg.OperationalError:
        return False


class PostgresServer:
    """A private cluster: start, stop (or kill) and start it again;
    ``settings`` are more ``name=value`` server settings.
    """

    def __init__(self, port: int, *settings: str) -> None:
        self.port = port
        self.settings = settings
        self.root = Path(tempfile.mkdtemp(prefix="dramatiq-unique-pg-"))
        self.data, self.sockets = self.root / "data", self.root / "run"
        self.url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
        initdb, self.pg_ctl = _program("initdb"), _program("pg_ctl")
        if initdb is None or self.pg_ctl is None:
            pytest.fail("the PostgreSQL server programs (initdb, pg_ctl) are not installed: " + INSTALL)
        self.sockets.mkdir()
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres")
            shutil.chown(self.sockets, "postgres")
        self._run([initdb, "-D", str(self.data), "-U", "postgres", "-A", "trust", "--no-sync"])

    def _run(self, command: list[str]) -> None:
        done = subprocess.run(_as_owner() + command, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            pytest.fail(f"{' '.join(command[:2])} failed: {done.stderr.strip() or done.stdout.strip()}")

    def start(self) -> None:
        options = f"-p {self.port} -k {self.sockets} -c fsync=off -c listen_addresses=127.0.0.1"
        options += "".join(f" -c {setting}" for setting in self.settings)
        assert self.pg_ctl is not None
        self._run([self.pg_ctl, "-D", str(self.data), "-o", options, "-l", str(self.root / "log"), "-w", "start"])
        deadline = time.monotonic() + 30
        while not _answers(self.url):
            if time.monotonic() > deadline:
                pytest.fail(f"PostgreSQL did not start on port {self.port}: see {self.root / 'log'}")
            time.sleep(0.05)

    def stop(self, mode: str = "fast") -> None:
        assert self.pg_ctl is not None
        self._run([self.pg_ctl, "-D", str(self.data), "-m", mode, "-w", "stop"])

    def remove(self) -> None:
        try:
            self.stop("immediate")
        except BaseException:
            pass
        shutil.rmtree(self.root, ignore_errors=True)


def database_on(url: str) -> Iterator[str]:
    """A fresh database on the server at ``url``, held by a connection of
    this session and dropped afterwards.  The databases of sessions that
    ended without dropping theirs are dropped first.
    """
    import psycopg

    drop_stale_databases(url)
    name = session_name()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    try:
        # Held open all session: a database nobody is connected to is
        # one whose session is gone.
        keeper = psycopg.connect(with_database(url, name), autocommit=True)
        try:
            yield with_database(url, name)
        finally:
            keeper.close()
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def drop_stale_databases(url: str) -> None:
    """Drop the ``du_test_*`` databases on the server at ``url`` made
    before this session started that nobody is connected to: an
    interrupted session's.
    """
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        idle = [row[0] for row in conn.execute(
            "SELECT datname FROM pg_database d"
            " WHERE NOT EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.datname = d.datname)")]
        for name in filter(stale, idle):
            try:
                # No FORCE: a session that connected since is not gone.
                conn.execute(f"DROP DATABASE IF EXISTS {name}")
            except psycopg.errors.ObjectInUse:
                pass


def with_database(url: str, name: str) -> str:
    """``url`` (a ``postgresql://`` URL) naming database ``name`` instead."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{name}"))


class PgBouncer:
    """A private ``pgbouncer`` in transaction mode in front of a server."""

    def __init__(self, port: int, *, server_port: int, dbname: str) -> None:
        program = _program("pgbouncer") or (
            "/usr/sbin/pgbouncer" if Path("/usr/sbin/pgbouncer").exists() else None)
        if program is None:
            pytest.fail("pgbouncer is not installed: run `apt-get install pgbouncer`.")
        self.root = Path(tempfile.mkdtemp(prefix="dramatiq-unique-pgbouncer-"))
        (self.root / "users.txt").write_text('"postgres" ""\n')
        (self.root / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"{dbname} = host=127.0.0.1 port={server_port} dbname={dbname}\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {self.root / 'users.txt'}\n"
            "pool_mode = transaction\ndefault_pool_size = 4\nmax_client_conn = 100\n"
            f"logfile = {self.root / 'log'}\n"
        )
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres")
            for name in ("users.txt", "pgbouncer.ini"):
                shutil.chown(self.root / name, "postgres")
        self.process = subprocess.Popen(
            _as_owner() + [program, str(self.root / "pgbouncer.ini")],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        self.url = f"postgresql://postgres@127.0.0.1:{port}/{dbname}"
        deadline = time.monotonic() + 10
        while not _answers(self.url):
            if time.monotonic() > deadline or self.process.poll() is not None:
                self.process.kill()
                pytest.fail(f"pgbouncer did not start: {self.process.stderr.read() if self.process.stderr else ''}")
            time.sleep(0.05)

    def stop(self) -> None:
        self.process.terminate()
        self.process.communicate()  # waits, and closes its stderr pipe
        shutil.rmtree(self.root, ignore_errors=True)


def empty(backend: object) -> None:
    """Delete every row of a PostgresBackend's table."""
    from dramatiq_unique.backends.postgres import sql

    backend.create_schema()  # type: ignore[attr-defined]
    with backend._connection() as conn:  # type: ignore[attr-defined]
        conn.execute(f"DELETE FROM {sql.LOCKS}")
