"""The PostgreSQL lock backend: :class:`PostgresBackend`, which runs the
in-memory rules on each key's state stored as JSON (:mod:`.state`).
"""

from .backend import PostgresBackend

__all__ = ["PostgresBackend"]
