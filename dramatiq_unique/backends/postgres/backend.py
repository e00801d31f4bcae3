"""A lock backend on PostgreSQL.

Each call is one transaction of two round trips (:func:`.sql.opening`,
:func:`.sql.closing`): lock the rows of its keys (in key order, so that
two calls never deadlock), run :class:`~..rules.LockRules`'s verb on
their state at the server's clock (:mod:`.state`), write back and
commit.  Nothing outlives its transaction, so PgBouncer's transaction
mode works.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence, TypeVar, Union

try:
    import psycopg
    import psycopg_pool
    from psycopg.conninfo import conninfo_to_dict, make_conninfo
except ModuleNotFoundError as e:  # tested in a subprocess: tests/test_postgres.py
    raise ModuleNotFoundError(
        f"{e}: PostgresBackend needs psycopg 3 and psycopg_pool, which come with the postgres extra: "
        "run `pip install 'dramatiq-unique[postgres]'`.",
        name=e.name,
    ) from None

from ...background import pid
from ...errors import ConfigurationError, LockBackendError
from ..base import glob_pattern
from ..capabilities import BatchedReleases, NewestWins, RenewsNatively, Reschedules, release_then_start
from ..records import Copy, LockInfo, Release, Start, Waiter
from ..rules import LockRules
from . import sql
from .state import DEFAULT_FENCE_MEMORY, Row, apply, run

if TYPE_CHECKING:
    from .native import NativeExtender

T = TypeVar("T")

logger = logging.getLogger(__name__)

#: How long, in seconds, a call waits for a connection, and a connection
#: for the server: a PostgreSQL that is down fails lock calls, not hangs workers.
DEFAULT_TIMEOUT = 5.0

#: The ``statement_timeout`` set in each transaction, in milliseconds.
DEFAULT_STATEMENT_TIMEOUT = 5_000

#: The most connections a process's pool opens.
DEFAULT_POOL_SIZE = 10

#: How often, in ms, a process offers to sweep expired rows (one at a time).
DEFAULT_SWEEP_INTERVAL = 60_000

#: How many expired rows one sweep transaction deletes at most.
DEFAULT_SWEEP_BATCH = 500

#: How many batches one sweep deletes at most.
DEFAULT_SWEEP_BATCHES = 20


def _without_password(url: str) -> str:
    try:
        params = conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "<an invalid URL>"
    host, port, dbname = params.get("host", ""), params.get("port", ""), params.get("dbname", "")
    user = f"{params['user']}@" if params.get("user") else ""
    return f"postgresql://{user}{host}{':' + str(port) if port else ''}/{dbname}"


def check_url(conninfo: str) -> None:
    """Raise ConfigurationError when ``conninfo`` does not parse; an unknown
    host is left to the boot check (it may not be in DNS yet), as on Redis.
    """
    try:
        conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError as e:
        raise ConfigurationError(f"PostgresBackend cannot parse the URL {conninfo!r}: {e}") from None


def _key(key: str, *_: Any, **__: Any) -> list[str]:
    """The keys locked by a verb that names one key first."""
    return [key]


def _key_and_copy(key: str, *_: Any, copy: Optional[Copy] = None, **__: Any) -> list[str]:
    """The keys locked by a verb that names a key and maybe a :class:`Copy`."""
    return [key] if copy is None else [key, copy.key]


def _copy_key(copy: Copy, *_: Any, **__: Any) -> list[str]:
    """The keys a verb of the reschedule protocol locks."""
    return [copy.key]


def _start_keys(key: str, *_: Any, copy: Copy, queue_key: Optional[str] = None, **__: Any) -> list[str]:
    """The keys a start locks: the run lock, the copy's, the enqueue lock."""
    return [key, copy.key] + ([queue_key] if queue_key else [])


def _in_transaction(verb: str, keys: Callable[..., list[str]]) -> Any:
    """A method running :class:`LockRules`'s ``verb`` with its arguments in
    one transaction, on the locked rows of the keys ``keys`` finds in them.
    """
    rule = getattr(LockRules, verb)

    @functools.wraps(rule)
    def method(self: "PostgresBackend", *args: Any, **kwargs: Any) -> Any:
        return self._locked(keys(*args, **kwargs), lambda rules: rule(rules, *args, **kwargs))

    return method


class PostgresBackend(Reschedules, NewestWins, BatchedReleases, RenewsNatively):
    """A lock backend that stores locks in PostgreSQL (10 or later).

    Parameters:
      url(str): A ``postgresql://`` URL, or any libpq connection string.
      pool(psycopg_pool.ConnectionPool): A pool of autocommit connections, instead of ``url``.
      timeout(float): How long a call waits for a pool connection, and a
        new connection for the server, in seconds.
      statement_timeout(int): The longest a call's statements may take, in ms.
      max_size(int): The most connections the pool opens.
      prepare_threshold(int): psycopg's, for the reads and the sweep; None
        prepares nothing, as PgBouncer's transaction mode needs before 1.21
        (from 1.21, with ``max_prepared_statements``, 5 saves a little).
      synchronous_commit(str): Each lock transaction's, e.g. ``"off"``,
        which halves a call's time, and a server crash can then lose the
        last few hundred ms of locks (see docs/postgres.md); None keeps the
        server's.  A transaction that only releases, promoting no waiter,
        commits with ``off`` whatever this says.
      create_schema(bool): Create the missing table on first use; False
        expects :meth:`create_schema` to have been run.
      min_replicas(int): Refused above 0: PostgreSQL waits for standbys
        itself (``synchronous_standby_names``).
      **connect: More libpq connection parameters.

    Deadlines and fences come from the server's ``clock_timestamp()``.
    """

    def __init__(
        self,
        *,
        url: Optional[str] = None,
        pool: Optional[Any] = None,
        timeout: float = DEFAULT_TIMEOUT,
        statement_timeout: int = DEFAULT_STATEMENT_TIMEOUT,
        max_size: int = DEFAULT_POOL_SIZE,
        prepare_threshold: Optional[int] = None,
        synchronous_commit: Optional[str] = None,
        create_schema: bool = True,
        sweep_interval: int = DEFAULT_SWEEP_INTERVAL,
        sweep_batch: int = DEFAULT_SWEEP_BATCH,
        fence_memory: int = DEFAULT_FENCE_MEMORY,
        min_replicas: int = 0,
        min_replicas_timeout: int = 0,
        **connect: Any,
    ) -> None:
        if min_replicas:
            raise ConfigurationError(
                f"min_replicas={min_replicas} is a RedisBackend option: PostgresBackend waits for standbys "
                "through the server instead. List them in synchronous_standby_names (with synchronous_commit "
                "on or remote_apply), and every commit of a lock waits for them."
            )
        if pool is None and url is None:
            raise ConfigurationError("PostgresBackend needs url= (postgresql://...) or pool=.")
        self.url = url
        self.timeout = timeout
        self.statement_timeout = str(int(statement_timeout))
        if synchronous_commit is None:
            self._settings, self._setting_values = sql.STATEMENT_TIMEOUT, [self.statement_timeout]
        else:
            self._settings = sql.STATEMENT_TIMEOUT_AND_COMMIT
            self._setting_values = [self.statement_timeout, str(synchronous_commit)]
        self._opening = sql.opening(self._settings)
        self.create = create_schema
        self.sweep_interval = sweep_interval
        self.sweep_batch = sweep_batch
        self.fence_memory = fence_memory
        if pool is None:
            assert url is not None
            check_url(url)
            connect.setdefault("connect_timeout", max(1, round(timeout)))
            self.conninfo = make_conninfo(url, **connect)
            self._kwargs: dict[str, Any] = {"autocommit": True, "prepare_threshold": prepare_threshold}
            self._max_size = max_size
            self._own_pool = True
        else:
            self.conninfo = pool.conninfo
            self._own_pool = False
        self.pool: Any = pool
        self._pool_pid = pid()
        self._pool_lock = threading.Lock()
        self._pool_lost = False
        self._ready = False
        self._ready_lock = threading.Lock()
        self._next_sweep = time.monotonic() + sweep_interval / 1000

    @classmethod
    def from_url(cls, url: str, **options: Any) -> "PostgresBackend":
        """A backend on the PostgreSQL at ``url``, with the constructor's ``options``."""
        return cls(url=url, **options)

    def describe(self) -> str:
        return f"PostgresBackend({_without_password(self.conninfo)})"

    def close(self) -> None:
        """Close the pool this backend made."""
        if self._own_pool and self.pool is not None and self._pool_pid == pid():
            self.pool.close()
            self.pool = None

    # Schema ------------------------------------------------------------

    def create_schema(self) -> None:
        """Create the missing table, in one transaction (safe in several processes at once).

        Raises:
          LockBackendError: the database refused (e.g. no CREATE privilege);
            nothing was created.
        """
        try:
            with self._connection() as conn, conn.transaction():
                for statement in sql.CREATE:
                    conn.execute(statement)
        except psycopg.errors.Error as e:
            if isinstance(e, psycopg.OperationalError):
                raise
            raise LockBackendError(
                f"{self.describe()} refused to create the table {sql.LOCKS}: {e}".rstrip()
                + ". Run PostgresBackend(...).create_schema() as a role "
                "that may create tables in the schema, or grant CREATE on it; nothing was created.",
                backend=self.describe(),
            ) from e
        self._ready = True

    def _ensure_schema(self) -> None:
        if self._ready:
            return
        with self._ready_lock:
            if self._ready:
                return
            with self._connection() as conn:
                exists = conn.execute(sql.EXISTS).fetchone()
            if exists is None or exists[0] is None:
                if not self.create:
                    raise LockBackendError(
                        f"{self.describe()} has no table {sql.LOCKS}: run PostgresBackend(...).create_schema(), "
                        "or pass create_schema=True.",
                        backend=self.describe(),
                    )
                self.create_schema()
            self._ready = True

    def check(self, key: str) -> None:
        """:meth:`LockReads.check`, first connecting alone: libpq says why it cannot, a pool only "timeout"."""
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            conn.execute("SELECT 1")
        self.inspect(key)

    # Transactions ------------------------------------------------------

    @contextlib.contextmanager
    def _connection(self) -> Iterator[Any]:
        if self._own_pool and (self.pool is None or self._pool_pid != pid()):
            self._open_pool()
        try:
            with self._direct_connection() if self._pool_lost else self.pool.connection(timeout=self.timeout) as conn:
                yield conn
        except psycopg_pool.PoolTimeout:
            # A pool short of its size could not connect; its backoff doubles, so after a restart it may
            # come back many seconds late: connect directly until the server answers (docs/postgres.md).
            if self._own_pool and self.pool.get_stats().get("pool_size", 0) < self._max_size:
                self._pool_lost = True
            raise

    def _direct_connection(self) -> Any:
        """A connection of its own, while the pool cannot connect; the first that succeeds replaces the pool."""
        conn = psycopg.connect(self.conninfo, **self._kwargs)
        with self._pool_lock:
            if self._pool_lost:
                old, self.pool = self.pool, self._new_pool()
                self._pool_lost = False
                threading.Thread(target=old.close, name="dramatiq-unique-old-pool", daemon=True).start()
        return conn

    def _open_pool(self) -> None:
        """Open this process's pool, again in a forked child (the parent's connections are not its own)."""
        with self._pool_lock:
            if self.pool is not None and self._pool_pid == pid():
                return
            self.pool = self._new_pool()
            self._pool_pid = pid()
            self._pool_lost = False

    def _new_pool(self) -> Any:
        pool = psycopg_pool.ConnectionPool(
            self.conninfo,
            min_size=1,
            max_size=self._max_size,
            kwargs=self._kwargs,
            timeout=self.timeout,
            open=False,
            name="dramatiq-unique",
        )
        pool.open(wait=False)
        return pool

    def _locked(self, keys: Sequence[str], verb: Callable[[LockRules], T]) -> T:
        """Run ``verb`` on the locked rows of ``keys``: one transaction, two queries."""
        self._ensure_schema()
        payload = json.dumps(sorted(set(keys)))
        for attempt in range(2):
            sent, conn = False, None
            try:
                with self._connection() as conn:
                    cursor = psycopg.ClientCursor(conn)
                    cursor.execute(self._opening, [*self._setting_values, payload])
                    while cursor.nextset():
                        pass
                    rows: list[Row] = cursor.fetchall()
                    applied = apply(rows, verb, fence_memory=self.fence_memory)
                    parameters = [value for write in applied.writes for value in write] + applied.deletes
                    closing = sql.closing(len(applied.writes), len(applied.deletes))
                    sent = True
                    cursor.execute(closing, parameters)
                break
            except psycopg.OperationalError:
                # Broken before a write was sent: rolled back, so safe to try
                # once more, after the pool drops its other dead connections
                # (a restarted server leaves every idle one dead).
                if sent or attempt or conn is None or not conn.broken:
                    raise
                self.pool.check()
        self._maybe_sweep()
        return applied.result  # type: ignore[no-any-return]

    def _read(self, statement: str, parameter: str, verb: Callable[[LockRules], T]) -> T:
        """Run ``verb`` on the rows ``statement`` reads, without locks."""
        self._ensure_schema()
        with self._connection() as conn:
            rows: list[Row] = conn.execute(statement, [parameter]).fetchall()
        return run(rows, verb)

    def _maybe_sweep(self) -> None:
        """Start a sweep when one is due, on a thread of its own: no lock call waits for one."""
        if time.monotonic() < self._next_sweep:
            return
        self._next_sweep = time.monotonic() + self.sweep_interval / 1000
        threading.Thread(target=self._sweep_in_background, name="dramatiq-unique-sweep", daemon=True).start()

    def _sweep_in_background(self) -> None:
        try:
            self.sweep()
        except Exception as e:  # the next interval tries again
            logger.warning("Could not sweep expired locks from %s: %r", self.describe(), e)

    def sweep(self, *, batches: int = DEFAULT_SWEEP_BATCHES) -> Optional[int]:
        """Delete expired rows, ``sweep_batch`` per transaction, unless another process sweeps.

        Returns:
          int: How many rows were deleted, or None when another was sweeping.
        """
        self._ensure_schema()
        deleted = 0
        for _ in range(batches):
            with self._connection() as conn, conn.transaction():
                row = conn.execute(sql.SWEEPING).fetchone()
                if row is None or row[0] != "true":
                    return None if deleted == 0 else deleted
                count = conn.execute(sql.SWEEP, [self.sweep_batch]).fetchone()
            done = int(count[0]) if count else 0
            deleted += done
            if done < self.sweep_batch:
                break
        return deleted

    # The verbs: each the rules' own, on the locked rows (_in_transaction) --

    acquire = _in_transaction("acquire", _key_and_copy)
    start = _in_transaction("start", _start_keys)
    release = _in_transaction("release", _key)
    join_line = _in_transaction("join_line", _copy_key)
    claim = _in_transaction("claim", _copy_key)
    _replace = _in_transaction("_replace", lambda call: [call.key])
    _current = _in_transaction("_current", lambda call: _key_and_copy(call.key, copy=call.copy))
    unreplace = _in_transaction("unreplace", _key)
    reap = _in_transaction("reap", _key)
    delete = _in_transaction("delete", _key)

    #: Releases go in one transaction, riding in front of the next start.
    batches_releases = True

    def release_many(self, locks: Sequence[tuple[Any, ...]]) -> list[Union[Release, Exception]]:
        if not locks:
            return []
        try:
            return self._locked([lock[0] for lock in locks], lambda rules: rules.release_many(locks))
        except Exception as e:
            return [e] * len(locks)

    def release_and_start(
        self, releases: Sequence[tuple[Any, ...]], key: str, owner: str, **start: Any
    ) -> tuple[list[Union[Release, Exception]], Union[Start, Exception]]:
        keys = [release[0] for release in releases] + _start_keys(key, **start)
        try:
            return self._locked(keys, lambda rules: release_then_start(rules, releases, key, owner, **start))
        except Exception as e:
            return [e] * len(releases), e

    def extend(self, locks: Sequence[tuple[str, str]], ttl: int) -> list[bool]:
        if not locks:
            return []
        return self._locked([key for key, _ in locks], lambda rules: rules.extend(locks, ttl))

    def confirm(self, locks: Sequence[tuple[str, str, int]]) -> list[bool]:
        if not locks:
            return []
        return self._locked([key for key, _, _ in locks], lambda rules: rules.confirm(locks))

    def native_extender(self) -> "NativeExtender":
        """``extend`` on a libpq connection of its own (:class:`.native.NativeExtender`)."""
        from .native import NativeExtender

        return NativeExtender(self.conninfo, statement_timeout=self.statement_timeout, fence_memory=self.fence_memory)

    # Operators' reads --------------------------------------------------

    def delete_prefix(self, prefix: str) -> int:
        self._ensure_schema()
        with self._connection() as conn:
            return int(conn.execute(sql.DELETE_PREFIX, [sql.like_literal(prefix)]).rowcount)

    def inspect(self, key: str) -> Optional[LockInfo]:
        return self._read(sql.READ, key, lambda rules: rules.inspect(key))

    def waiters(self, key: str) -> list[Waiter]:
        return self._read(sql.READ, key, lambda rules: rules.waiters(key))

    def scan(self, pattern: str) -> Iterator[str]:
        keys = self._read(sql.SCAN, sql.like_prefix(pattern), lambda rules: list(rules.scan(pattern)))
        match = glob_pattern(pattern).fullmatch
        return iter([key for key in keys if match(key)])
