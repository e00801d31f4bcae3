"""Lease renewal on a native OS thread, for workers under gevent (see
:class:`~..capabilities.RenewsNatively`): on a libpq connection of its own
(``psycopg.pq.PGconn``), whose blocking calls hold only the calling
thread, the same transaction as ``PostgresBackend.extend``.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Sequence

from psycopg import pq

from . import sql
from .state import Row, apply


class NativeExtender:
    """``extend`` on one libpq connection, used by one thread at a time.

    Parameters:
      conninfo(str): The libpq connection string.
      statement_timeout(str): The most ms a renewal's statements may take.
      fence_memory(int): As ``PostgresBackend``'s.
    """

    def __init__(self, conninfo: str, *, statement_timeout: str, fence_memory: int) -> None:
        self.conninfo = conninfo
        self.statement_timeout = int(statement_timeout)
        self.fence_memory = fence_memory
        self._conn: Optional[Any] = None

    def __call__(self, locks: Sequence[tuple[str, str]], ttl: int, *, timeout: float) -> list[bool]:
        """Extend each ``(key, owner)`` to ``ttl`` ms from now, within ``timeout`` ms.

        Raises:
          TimeoutError: no time was left.
          psycopg.OperationalError: the connection or the transaction
            failed; the connection is closed.
        """
        if timeout <= 0:
            raise TimeoutError("the lease ran out before it could be renewed")
        if not locks:
            return []
        try:
            return self._extend(locks, ttl, int(min(timeout, self.statement_timeout)))
        except BaseException:
            self.close()
            raise

    def _extend(self, locks: Sequence[tuple[str, str]], ttl: int, timeout: int) -> list[bool]:
        self._query("BEGIN", [])
        self._query(sql.STATEMENT_TIMEOUT, [str(max(timeout, 1))])
        rows = self._query(sql.LOCK, [json.dumps(sorted({key for key, _ in locks}))])
        applied = apply(rows, lambda rules: rules.extend(locks, ttl), fence_memory=self.fence_memory)
        for write in applied.writes:
            self._query(sql.WRITE, write)
        for key in applied.deletes:
            self._query(sql.DELETE, [key])
        self._query("COMMIT", [])
        return list(applied.result)

    def _connection(self) -> Any:
        if self._conn is None:
            conn = pq.PGconn.connect(self.conninfo.encode())
            if conn.status != pq.ConnStatus.OK:
                message = conn.error_message
                conn.finish()
                raise _error(message)
            self._conn = conn
        return self._conn

    def _query(self, statement: str, params: list[str]) -> list[Row]:
        conn = self._connection()
        result = conn.exec_params(sql.numbered(statement).encode(), [p.encode() for p in params])
        if result.status not in (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK):
            raise _error(result.error_message or b"")
        return [
            tuple(
                None if value is None else bytes(value).decode()
                for value in (result.get_value(row, column) for column in range(result.nfields))
            )
            for row in range(result.ntuples)
        ]

    def close(self) -> None:
        """Close the connection; the next call opens a new one."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.finish()


def _error(message: bytes) -> Exception:
    import psycopg

    return psycopg.OperationalError(message.decode(errors="replace").strip() or "the renewal connection failed")
