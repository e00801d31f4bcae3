"""The package's background threads, on one base.

Each background task of a process (the lease keeper, the confirmer, the
periodic reaper, the hand-off timer) runs a loop on a
:class:`BackgroundThread`, which gives every one of them the same
life cycle:

* **lazy start**: the thread starts with the first call that needs it
  (:meth:`~BackgroundThread.ensure_started`, one field read when it
  runs already), and again after it ended or failed;
* **fork**: a forked child has none of its parent's threads, so each
  thread is marked as not running there (``os.register_at_fork``) and
  its owner's ``on_fork`` resets what the parent left half-done;
* **stop** and a **bounded drain**: :meth:`~BackgroundThread.stop` wakes
  the loop and waits for it at most a given time;
  :meth:`~BackgroundThread.drain` waits, bounded, for a condition;
* **errors are logged, not lost**: an exception that ends a loop is
  logged with its traceback, and the next use starts a new thread;
* **gevent**: under ``dramatiq-gevent``'s monkey-patching a thread is a
  greenlet on the actor's own OS thread.  A task that must go on while
  an actor holds the hub (lease renewal) asks for ``native=True`` and
  then runs on a real OS thread, which waits on OS locks only and hands
  everything that touches patched state (logging, callbacks, events)
  to the hub with :meth:`~BackgroundThread.report`.  Every other task
  stays a greenlet, as correct under patching as any of Dramatiq's.
"""

from __future__ import annotations

import os
import threading
import time as mod_time
import weakref
from typing import Any, Callable, Optional, Union

from dramatiq.logging import get_logger

from .compat import hub_caller, native_lock, start_native_thread, threads_are_green
from .forks import pid

#: How long :meth:`BackgroundThread.stop` waits for the loop to end, in
#: milliseconds.
DEFAULT_STOP_TIMEOUT = 5_000

#: How often a bounded wait looks again, in milliseconds: short enough
#: for a drain, long enough that a waiting greenlet lets others run.
DEFAULT_POLL = 10

#: The loop of a background thread: called with its thread, it returns
#: once ``thread.stopping`` is set (or whenever it is done).
Loop = Callable[["BackgroundThread"], None]


def _now_ms() -> float:
    return mod_time.monotonic() * 1000


class Wakeup:
    """An auto-reset event on one plain lock: :meth:`wait` returns when
    :meth:`set` was called since the last wait, or after a timeout.

    Made of an OS lock for a native thread, so that no gevent primitive
    crosses the thread boundary: the side that sets it never blocks.
    """

    def __init__(self, lock: Any) -> None:
        self._lock = lock
        self._lock.acquire()  # held: the next wait blocks until set()

    def set(self) -> None:
        """Wake the waiter; never blocks."""
        try:
            self._lock.release()
        except RuntimeError:  # set already, not waited for yet
            pass

    def wait(self, timeout: float) -> bool:
        """Wait at most ``timeout`` milliseconds.

        Returns:
          bool: True when it was set.
        """
        return bool(self._lock.acquire(True, max(timeout, 0) / 1000))


class BackgroundThread:
    """One background thread of a process, running ``loop``.

    Parameters:
      name(str): The thread's name, e.g. ``"dramatiq-unique-leases"``.
      loop(callable): Called with this object on the thread; it waits
        with :meth:`wait` and returns when :attr:`stopping` is set.
      native(bool or callable): Whether the loop must run on an OS
        thread when gevent has patched threads (decided at each start,
        so a callable can say whether it can); ignored otherwise.
      on_fork(callable): Called in a forked child, before any of its
        code runs, to drop what the parent's thread had under way.
    """

    def __init__(
        self,
        *,
        name: str,
        loop: Loop,
        native: Union[bool, Callable[[], bool]] = False,
        on_fork: Optional[Callable[[], None]] = None,
    ) -> None:
        self.logger = get_logger(__name__, type(self))
        self.name = name
        self.loop = loop
        self.wants_native = native
        self.on_fork = on_fork
        self._start_lock = threading.Lock()
        self._reset()
        _LIVE.add(self)

    def _reset(self) -> None:
        #: The process whose thread runs the loop; None when none does.
        #: A field read per job, where ``is_alive()`` costs two calls.
        self.running_in: Optional[int] = None
        self.native = False
        self.stopping = False
        self._thread: Optional[threading.Thread] = None
        self._finished = True
        self._wakeup = Wakeup(threading.Lock())
        self._to_hub: Callable[[Callable[[], None]], None] = _call

    def _forked(self) -> None:
        # The parent's start lock may have been held at the fork.
        self._start_lock = threading.Lock()
        self._reset()
        if self.on_fork is not None:
            self.on_fork()

    # Life cycle ----------------------------------------------------------

    def ensure_started(self) -> None:
        """Start the thread unless it runs in this process."""
        if self.running_in == pid():
            return
        with self._start_lock:
            if self.running_in == pid():
                return
            self.stopping = False
            self.native = threads_are_green() and self._wants_native()
            self._wakeup = Wakeup(native_lock() if self.native else threading.Lock())
            self._to_hub = hub_caller() if self.native else _call
            self._finished = False
            # Before the start: a loop that ends at once clears it after.
            self.running_in = pid()
            try:
                self._start()
            except BaseException:
                self.running_in, self._finished = None, True  # a thread that failed to start is tried again
                raise

    def _start(self) -> None:
        if self.native:
            start_native_thread(self._main)
        else:
            self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
            self._thread.start()

    def _wants_native(self) -> bool:
        wants = self.wants_native
        return bool(wants() if callable(wants) else wants)

    def _main(self) -> None:
        try:
            self.loop(self)
        except Exception as error:
            self._stopped_by(error)
        finally:
            # Under the start lock would block a native thread on a
            # greenlet's lock: the two fields are set in this order, and
            # a start that reads the old pid waits for nothing.
            self.running_in = None
            self._finished = True

    def _stopped_by(self, error: Exception) -> None:
        self.report(lambda: self.logger.error(
            "%s stopped on an error; the next use starts it again.", self.name, exc_info=error))

    def wake(self) -> None:
        """Have the loop look again now; never blocks."""
        self._wakeup.set()

    def wait(self, timeout: float) -> bool:
        """In the loop: sleep until :meth:`wake`, :meth:`stop` or
        ``timeout`` milliseconds.

        Returns:
          bool: True when woken.
        """
        return self._wakeup.wait(timeout)

    def stop(self, *, timeout: float = DEFAULT_STOP_TIMEOUT) -> bool:
        """Ask the loop to end and wait for it, at most ``timeout``
        milliseconds.

        Returns:
          bool: True when it ended (or never ran).
        """
        self.stopping = True
        self._wakeup.set()
        thread = self._thread
        if thread is not None and not self.native:
            if thread is not threading.current_thread():
                thread.join(timeout=timeout / 1000)
            return not thread.is_alive()
        # A native thread is never joined: a greenlet would block the hub
        # on its OS lock.  Looked at with sleeps, which yield.
        return self.drain(lambda: self._finished, timeout=timeout)

    @staticmethod
    def drain(done: Callable[[], bool], *, timeout: float, poll: float = DEFAULT_POLL) -> bool:
        """Wait until ``done()`` is true, at most ``timeout`` ms, looking
        every ``poll`` ms (a sleep, which yields under gevent).

        Returns:
          bool: whether it became true.
        """
        deadline = _now_ms() + timeout
        while not done():
            left = deadline - _now_ms()
            if left <= 0:
                return False
            mod_time.sleep(min(left, poll) / 1000)
        return True

    # Crossing back ----------------------------------------------------------

    def report(self, call: Callable[[], None]) -> None:
        """Run ``call`` where it may touch patched state: on the hub, from
        a native thread; here otherwise.  What it raises is logged.
        """
        self._to_hub(lambda: self._logged(call))

    def _logged(self, call: Callable[[], None]) -> None:
        try:
            call()
        except Exception:
            self.logger.exception("%s could not report.", self.name)


def _call(call: Callable[[], None]) -> None:
    call()


_LIVE: "weakref.WeakSet[BackgroundThread]" = weakref.WeakSet()


def _after_fork() -> None:
    for thread in list(_LIVE):
        thread._forked()


os.register_at_fork(after_in_child=_after_fork)
