"""This process's id, read without a system call.

``os.getpid`` is a system call on every read, and the hot paths of a
worker (an owner token per job, a fork check per lock call) read it per
job.  The id here is refreshed in a forked child before any of its
code runs.
"""

from __future__ import annotations

import os

_pid = os.getpid()


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


def pid() -> int:
    """This process's id."""
    return _pid
