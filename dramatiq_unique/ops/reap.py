"""The operators' reap: ``dramatiq-unique reap`` and
:meth:`~dramatiq_unique.ops.admin.LockAdmin.reap` find, and optionally
release, the enqueue locks whose message vanished from the Redis broker.

The reap itself is :mod:`dramatiq_unique.worker.reap`, which a worker's
periodic reaper (``reap_interval``) also runs; its names are kept here
for the operators' side.
"""

from __future__ import annotations

from ..worker.reap import DEFAULT_BATCH, DEFAULT_MIN_AGE, Reaper, ReapReport, RedisQueues, Suspect, queue_of

__all__ = ["DEFAULT_BATCH", "DEFAULT_MIN_AGE", "ReapReport", "Reaper", "RedisQueues", "Suspect", "queue_of"]
