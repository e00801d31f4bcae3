"""The monotonic clock of the package's background tasks, in milliseconds.

One home for it: the lease keeper, the releaser, the confirmer, the
retries of failed releases, the hand-off timer and the background
threads' bounded waits all time their deadlines with it.  It imports
nothing of the package, so every module may use it.
"""

from __future__ import annotations

import time


def now_ms() -> float:
    """Monotonic milliseconds: for deadlines and intervals within this
    process, never for times stored in the backend (those are the
    server's or wall-clock milliseconds).
    """
    return time.monotonic() * 1000
