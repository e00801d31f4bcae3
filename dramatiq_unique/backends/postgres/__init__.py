"""The PostgreSQL lock backend: :class:`PostgresBackend` (in
:mod:`.backend`), which runs the in-memory backend's rules
(:class:`~..rules.LockRules`) on each key's state stored as JSON
(:mod:`.state`), with the statements of
:mod:`.sql` and lease renewal for gevent in :mod:`.native`.
"""

from .backend import PostgresBackend

__all__ = ["PostgresBackend"]
