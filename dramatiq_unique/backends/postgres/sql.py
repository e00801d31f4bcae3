"""The schema and statements of ``PostgresBackend``.

One table holds a row per lock key: its state in JSON (:mod:`.state`),
and when its last deadline passes; an expired row counts as absent
until the sweep deletes it.  Statements take and return text (JSON for
several values), so that they run through psycopg and through libpq
directly (:mod:`.native`, with :func:`numbered` placeholders).
"""

from __future__ import annotations

import functools
import re

#: In the names of all the backend creates: a new layout makes new tables.
SCHEMA_VERSION = 1

LOCKS = f"dramatiq_unique_v{SCHEMA_VERSION}_locks"

#: An advisory lock, so that concurrent first uses create the schema once.
SCHEMA_LOCK = 0x6471_5F75_6E69_7131  # "dq_uniq1"
#: Held by the one process that sweeps, for the sweep's transaction.
SWEEP_LOCK = 0x6471_5F75_6E69_7153  # "dq_uniqS"

#: Room on each page for the updated row, so that most updates are HOT (no index write, no vacuum).
FILLFACTOR = 70

CREATE = [
    f"SELECT pg_advisory_xact_lock({SCHEMA_LOCK})",
    f"""CREATE TABLE IF NOT EXISTS {LOCKS} (
        key text COLLATE "C" PRIMARY KEY,
        state jsonb NOT NULL,
        expires_at timestamptz NOT NULL
    ) WITH (fillfactor = {FILLFACTOR}, autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 1000)""",
    f"COMMENT ON TABLE {LOCKS} IS 'dramatiq-unique lock state, layout {SCHEMA_VERSION}: one row per lock key'",
]

#: Whether the table exists: its name, or NULL.
EXISTS = f"SELECT to_regclass('{LOCKS}')::text"

#: The server's clock, in Unix microseconds, as text.
CLOCK = "(extract(epoch FROM clock_timestamp()) * 1000000)::bigint::text"

#: Lock the rows of a JSON array of keys, in order, making missing ones:
#: each key, its state, and the clock read once it is locked.
LOCK = f"""INSERT INTO {LOCKS} AS t (key, state, expires_at)
    SELECT k, '{{}}', '-infinity' FROM jsonb_array_elements_text(%s::jsonb) AS k ORDER BY k COLLATE "C"
    ON CONFLICT (key) DO UPDATE SET key = EXCLUDED.key
    RETURNING t.key, t.state::text, {CLOCK}"""

#: Read a key's row without locking it; a last NULL-key row carries the clock.
READ = f"""SELECT key, state::text, NULL FROM {LOCKS} WHERE key = %s
    UNION ALL SELECT NULL, NULL, {CLOCK}"""

#: The keys matching a ``LIKE`` prefix, with their state, then the clock.
SCAN = f"""SELECT key, state::text, NULL FROM {LOCKS}
    WHERE key LIKE %s AND expires_at > clock_timestamp()
    UNION ALL SELECT NULL, NULL, {CLOCK}"""

#: Store a key's state (JSON) and expiry (server Unix ms): an index lookup.
WRITE = f"UPDATE {LOCKS} SET state = %s::jsonb, expires_at = to_timestamp(%s::bigint / 1000.0) WHERE key = %s"

DELETE = f"DELETE FROM {LOCKS} WHERE key = %s"

#: Whether this transaction holds the sweep: one process sweeps at a time.
SWEEPING = f"SELECT pg_try_advisory_xact_lock({SWEEP_LOCK})::text"

#: Delete up to a number of expired rows that nobody has locked: how many.
SWEEP = f"""WITH gone AS (
        DELETE FROM {LOCKS} WHERE key IN (
            SELECT key FROM {LOCKS} WHERE expires_at < clock_timestamp() LIMIT %s::int FOR UPDATE SKIP LOCKED)
        RETURNING 1)
    SELECT count(*)::text FROM gone"""

#: Bound the following statements' wait, in ms (libpq calls have no other timeout).
STATEMENT_TIMEOUT = "SELECT set_config('statement_timeout', %s, true)"

#: The same, and the transaction's ``synchronous_commit``.
STATEMENT_TIMEOUT_AND_COMMIT = (
    "SELECT set_config('statement_timeout', %s, true), set_config('synchronous_commit', %s, true)"
)


def opening(settings: str) -> str:
    """A lock call's first query, one message: begin, ``settings``, lock
    the rows, each statement timed alone: the timeout covers the row locks.
    """
    return f"BEGIN; {settings}; {LOCK}"


@functools.lru_cache(maxsize=256)
def closing(writes: int, deletes: int) -> str:
    """A lock call's last query, one message: the writes, deletes, and ``COMMIT``."""
    statements = [WRITE] * writes + [DELETE] * deletes + ["COMMIT"]
    return "; ".join(statements)


def numbered(statement: str) -> str:
    """``statement`` with its ``%s`` placeholders as ``$1``, ``$2``..."""
    counter = iter(range(1, 1000))
    return re.sub("%s", lambda _: f"${next(counter)}", statement)


#: Drop every key that starts with a prefix (a ``LIKE`` pattern).
DELETE_PREFIX = f"DELETE FROM {LOCKS} WHERE key LIKE %s"


def like_literal(prefix: str) -> str:
    """A ``LIKE`` pattern of the keys that start with ``prefix``."""
    return re.sub(r"([\\%_])", r"\\\1", prefix) + "%"


def like_prefix(pattern: str) -> str:
    """A ``LIKE`` pattern of the keys glob ``pattern`` can match (its literal
    start, as :func:`~dramatiq_unique.backends.base.glob_pattern` reads it).
    """
    literal, escaped = [], False
    for char in pattern:
        if not escaped and char in "*?[":
            break
        if not escaped and char == "\\":
            escaped = True
            continue
        literal.append(char)
        escaped = False
    return like_literal("".join(literal))
