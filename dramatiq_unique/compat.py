"""The Dramatiq internals this package uses, imported from one place.

dramatiq-unique runs on Dramatiq 1.17 and later 1.x, and on 2.x.  The
names below are not part of Dramatiq's public API, and some differ
between those versions; every other module imports them from here.
"""

from __future__ import annotations

import dramatiq
from dramatiq.asyncio import async_to_sync
from dramatiq.middleware import age_limit as age_limit_module
from dramatiq.middleware.prometheus import Prometheus

try:  # Dramatiq 2.x
    from dramatiq.worker import ConsumerThread
except ImportError:  # Dramatiq 1.x
    from dramatiq.worker import _ConsumerThread as ConsumerThread  # type: ignore[attr-defined,no-redef]

#: The installed Dramatiq, as ``(major, minor)``.
DRAMATIQ_VERSION = tuple(int(part) for part in dramatiq.__version__.split(".")[:2])

#: The logger of Dramatiq's worker threads, which logs ``"Message %s
#: was skipped."`` at WARNING for every skipped delivery (the same name
#: in 1.x, where the class is ``_WorkerThread``, and in 2.x).
WORKER_THREAD_LOGGER = "dramatiq.worker.WorkerThread"

#: The format of that log record, which :mod:`dramatiq_unique.quiet`
#: recognises by identity of text, not by a translation of it.
SKIPPED_MESSAGE_LOG = "Message %s was skipped."

#: ``age_limit_module.current_millis`` is AgeLimit's own clock, looked up
#: at call time (tests patch it), in 1.x and 2.x alike.

__all__ = [
    "ConsumerThread",
    "async_to_sync",
    "DRAMATIQ_VERSION",
    "Prometheus",
    "SKIPPED_MESSAGE_LOG",
    "WORKER_THREAD_LOGGER",
    "age_limit_module",
]
