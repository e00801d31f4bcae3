"""The monotonic clock of the package's background tasks, in milliseconds,
and the random numbers of their jitter.

One home for it: the lease keeper, the releaser, the confirmer, the
retries of failed releases, the hand-off timer and the background
threads' bounded waits all time their deadlines with it.  It imports
nothing of the package, so every module may use it.
"""

from __future__ import annotations

import os
import random
import time


def now_ms() -> float:
    """Monotonic milliseconds: for deadlines and intervals within this
    process, never for times stored in the backend (those are the
    server's or wall-clock milliseconds).
    """
    return time.monotonic() * 1000


#: The random numbers of the package's jitter and tokens: a generator
#: of its own, so that background threads never move the global
#: ``random`` state that an application (or Hypothesis, which warns when
#: it moves under a test) draws from; reseeded in a forked child, so that
#: forked workers do not jitter in step.
JITTER = random.Random()
if hasattr(os, "register_at_fork"):  # not on Windows
    os.register_at_fork(after_in_child=JITTER.seed)
