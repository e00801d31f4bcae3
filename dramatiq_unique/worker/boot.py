"""What a worker says at boot about its lock backend.

A worker whose lock backend does not answer when it boots logs one
ERROR naming the backend (its host) and the reason, and boots anyway:
the backend may come up later (a Redis that restarts, a name that is
not yet in DNS, a container started before its Redis), and until then
``on_backend_error`` decides, message by message, what a locked message
does (by default it fails and is retried; it never runs unlocked).  A
worker that refused to boot would stop its unlocked actors too, and
under the ``dramatiq`` command one worker process that exits stops all
of them.
"""

from __future__ import annotations

import logging

from ..backends.base import LockBackend

def reason(error: BaseException) -> str:
    """``error`` on one line, led by its type: what failed, and why."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def check_backend(backend: LockBackend, *, prefix: str, on_backend_error: str, logger: logging.Logger) -> bool:
    """Make one read of ``backend``; log one ERROR, naming it and
    why, when that fails.  Never raises.

    Parameters:
      backend(LockBackend): The worker's lock backend.
      prefix(str): The prefix of the lock keys: the key read is under it.
      on_backend_error(str): The setting, named in the line.
      logger(Logger): The middleware's logger.

    Returns:
      bool: True when the backend answered.
    """
    try:
        backend.check(f"{prefix}:!check")
    except Exception as error:
        logger.error(
            "Lock backend %s does not answer at worker boot (%s); the worker goes on, and until it answers, "
            "on_backend_error=%r decides what locked messages do.",
            backend.describe(),
            reason(error),
            on_backend_error,
        )
        return False
    return True
