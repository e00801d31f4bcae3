"""The contenders of ``python -m benchmarks --postgres``, on the same
``RedisBroker`` app as every other contender (see :mod:`.app`):

- ``pg_floor``: bare Dramatiq plus one committed single-row write per
  job, on the worker thread, before the job runs: what no lock stored
  in PostgreSQL can go below, on the same connection settings;
- ``pg_while_executing``: ``UniqueMiddleware`` with a
  ``PostgresBackend``, ``lock="while_executing"``.

psycopg is imported only when one of them is built.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import dramatiq

from dramatiq_unique import UniqueMiddleware

from .pg_server import FLOOR_TABLE

PG_FLOOR = "pg_floor"
PG_LOCK = "pg_while_executing"
CONTENDERS = (PG_FLOOR, PG_LOCK)

#: The worker's variable that carries the PostgreSQL connection string.
URL_VARIABLE = "BENCH_POSTGRES_URL"

#: The floor's write: a new row per job, committed on its own.
FLOOR_WRITE = (f"INSERT INTO {FLOOR_TABLE} (key, at) VALUES (%s, clock_timestamp()) "
               "ON CONFLICT (key) DO UPDATE SET at = EXCLUDED.at")


class PgFloor(dramatiq.Middleware):
    """One committed single-row write per job on the worker thread,
    through a psycopg connection of the thread's own, with the
    backend's connection settings (autocommit, nothing prepared).
    """

    def __init__(self, *, conninfo: str, namespace: str) -> None:
        self.conninfo = conninfo
        self.namespace = namespace
        self.threads = threading.local()

    def _connection(self) -> Any:
        conn = getattr(self.threads, "conn", None)
        if conn is None:
            import psycopg

            conn = self.threads.conn = psycopg.connect(self.conninfo, autocommit=True, prepare_threshold=None)
        return conn

    def before_process_message(self, broker: dramatiq.Broker, message: Any) -> None:
        raw = getattr(message, "_message", message)
        self._connection().execute(FLOOR_WRITE, [f"{self.namespace}:{raw.args[0]}"])


def install(
    broker: dramatiq.Broker, contender: str, *, namespace: str, postgres_url: Optional[str]
) -> tuple[Optional[UniqueMiddleware], dict[str, Any]]:
    """Add ``contender``'s middleware to ``broker``: its
    ``UniqueMiddleware``, if any, and the actor options it needs.

    Raises:
      ValueError: without a PostgreSQL URL.
    """
    if not postgres_url:
        raise ValueError(f"The contender {contender} needs a PostgreSQL URL (postgres_url=, or {URL_VARIABLE}).")
    if contender == PG_FLOOR:
        broker.add_middleware(PgFloor(conninfo=postgres_url, namespace=namespace))
        return None, {}
    from dramatiq_unique.backends.postgres import PostgresBackend

    unique = UniqueMiddleware(prefix=namespace, backend=PostgresBackend(url=postgres_url))
    broker.add_middleware(unique)
    return unique, {"lock": "while_executing", "lock_args": ["key"]}
