"""Quiets Dramatiq's WARNING for the deliveries we skip on purpose.

Dramatiq's worker logs ``WARNING Message ... was skipped.`` for every
``SkipMessage``.  A rescheduled delivery (and a copy that lost its
hand-off claim) is skipped on purpose and logs its own line at DEBUG,
so the WARNING would only flood the log: two waiting messages made 117
of them in 106 s.  :class:`QuietSkips` drops exactly those records.
A skip by any other middleware (AgeLimit, a user's) still logs as
before.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, cast

from ..compat import SKIPPED_MESSAGE_LOG, WORKER_THREAD_LOGGER
from .delivery import delivery

if TYPE_CHECKING:
    from dramatiq.broker import MessageProxy

_install_mutex = threading.Lock()


class QuietSkips(logging.Filter):
    """Drops ``"Message %s was skipped."`` records whose message the
    middleware marked ``quiet_skip``; passes every other record.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != SKIPPED_MESSAGE_LOG or not isinstance(record.args, tuple) or not record.args:
            return True
        state = delivery(cast("MessageProxy", record.args[0]))
        return state is None or not state.quiet_skip


def install() -> QuietSkips:
    """Add a :class:`QuietSkips` to Dramatiq's worker-thread logger,
    once per process, and return it.
    """
    logger = logging.getLogger(WORKER_THREAD_LOGGER)
    with _install_mutex:
        for existing in logger.filters:
            if isinstance(existing, QuietSkips):
                return existing
        quiet = QuietSkips()
        logger.addFilter(quiet)
        return quiet
