"""The package's background threads, on one base, with the clock and
the process id they read.

Each background task of a process (the lease keeper, the releaser, the
confirmer, the retries of failed releases, the periodic reaper, the
hand-off timer) runs a loop on a :class:`BackgroundThread`: it starts
lazily, is reset in a forked child, stops within a bound, logs an error
that ends it, retires a generation at once, and under gevent chooses a
greenlet or (``native=True``) an OS thread; see docs/reliability.md,
"Green threads (gevent)", "One life cycle".

The clock (:func:`now_ms`), the jitter (:data:`JITTER`) and the process
id (:func:`pid`) live here too: every background task times and
jitters its deadlines with them, and the Redis client's calls read the
process id on every call.  This module imports nothing of the package
but ``compat``, so every module may use it.
"""

from __future__ import annotations

import functools
import os
import random
import threading
import time as mod_time
import weakref
from abc import abstractmethod
from typing import Any, Callable, Generic, Optional, TypeVar, Union, cast

from dramatiq.logging import get_logger

from .compat import hub_caller, native_lock, start_native_thread, threads_are_green


def now_ms() -> float:
    """Monotonic milliseconds: for deadlines and intervals within this
    process, never for times stored in the backend (those are the
    server's or wall-clock milliseconds).
    """
    return mod_time.monotonic() * 1000


#: The random numbers of the package's jitter and tokens: a generator
#: of its own, so that background threads never move the global
#: ``random`` state that an application (or Hypothesis, which warns when
#: it moves under a test) draws from; reseeded in a forked child, so that
#: forked workers do not jitter in step.
JITTER = random.Random()

#: This process's id, read without a system call: ``os.getpid`` is one
#: on every read, and the hot paths of a worker (an owner token per job,
#: a fork check per lock call) read it per job.  Refreshed in a forked
#: child before any of its code runs.
_pid = os.getpid()


def pid() -> int:
    """This process's id."""
    return _pid

#: How long :meth:`BackgroundThread.stop` waits for the loop to end, in
#: milliseconds.
DEFAULT_STOP_TIMEOUT = 5_000

#: How often a bounded wait looks again, in milliseconds: short enough
#: for a drain, long enough that a waiting greenlet lets others run.
DEFAULT_POLL = 10

T = TypeVar("T")

#: The loop of a background thread: called with its thread, it returns
#: once ``thread.stopping`` is set (or whenever it is done).
Loop = Callable[["BackgroundThread"], None]


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
      on_wake(callable): Called by :meth:`wake` and :meth:`stop`, for a
        loop that waits on its owner's own condition rather than with
        :meth:`wait`: it notifies that condition, under its lock.
    """

    def __init__(
        self,
        *,
        name: str,
        loop: Loop,
        native: Union[bool, Callable[[], bool]] = False,
        on_fork: Optional[Callable[[], None]] = None,
        on_wake: Optional[Callable[[], None]] = None,
    ) -> None:
        self.logger = get_logger(__name__, type(self))
        self.name = name
        self.loop = loop
        self.wants_native = native
        self.on_fork = on_fork
        self.on_wake = on_wake
        self._start_lock = threading.Lock()
        #: Bumped by every start; the generation of the newest thread.
        self.generation = 0
        #: The newest generation that ended or was retired: its thread
        #: no longer owns the running mark.
        self._retired = 0
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
            wants = self.wants_native
            self.native = threads_are_green() and bool(wants() if callable(wants) else wants)
            self._wakeup = Wakeup(native_lock() if self.native else threading.Lock())
            self._to_hub = hub_caller() if self.native else _call
            self._finished = False
            self.generation += 1
            # Before the start: a loop that ends at once clears it after.
            self.running_in = pid()
            try:
                self._start(self.generation)
            except BaseException:
                self._clear(self.generation)  # a thread that failed to start is tried again
                raise

    def _start(self, generation: int) -> None:
        main = functools.partial(self._main, generation)
        if self.native:
            start_native_thread(main)
        else:
            self._thread = threading.Thread(target=main, name=self.name, daemon=True)
            self._thread.start()

    def _main(self, generation: int) -> None:
        try:
            self.loop(self)
        except Exception as error:
            self._stopped_by(error)
        finally:
            # Only while this thread still owns the mark: once retired, a
            # newer thread may hold it, and clearing it would let a third
            # start beside that one (or leave a stop() nothing to wait for).
            if self._retired != generation and self.generation == generation:
                self._clear(generation)

    def retire(self) -> None:
        """Give up the running mark of the newest thread now: the next
        :meth:`ensure_started` starts a new thread, whatever the old one
        still does before it returns.

        Called by a loop, under its owner's lock, as it decides to end
        (a submission made after that decision then starts a new
        thread, where it would otherwise find the old one still marked
        running), or by the owner to give up on a thread stuck in a call
        (the owner then ignores what that thread still reports).
        """
        if self.generation != self._retired:
            self._clear(self.generation)

    def _clear(self, generation: int) -> None:
        # Under the start lock would block a native thread on a
        # greenlet's lock.  No start can come between the check of the
        # caller and these writes: a start waits for the mark to clear,
        # and the generation is marked retired before it does.
        self._retired = generation
        self._finished = True
        self.running_in = None

    def _stopped_by(self, error: Exception) -> None:
        # A function of its own: ``error`` is unbound once its except clause ends, before the hub may run this.
        self.report(lambda: self.logger.error(
            "%s stopped on an error; the next use starts it again.", self.name, exc_info=error))

    def wake(self) -> None:
        """Have the loop look again now; never blocks on the loop."""
        self._wakeup.set()
        if self.on_wake is not None:
            self.on_wake()

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
        self.wake()
        thread = self._thread
        if thread is not None and not self.native:
            if thread is not threading.current_thread():
                thread.join(timeout=timeout / 1000)
            return not thread.is_alive()
        # A native thread is never joined: a greenlet would block the hub
        # on its OS lock.  Looked at with sleeps, which yield.
        deadline = now_ms() + timeout
        while not self._finished:
            left = deadline - now_ms()
            if left <= 0:
                return False
            mod_time.sleep(min(left, DEFAULT_POLL) / 1000)
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


B = TypeVar("B")
R = TypeVar("R")


class ThreadOwner(Generic[B]):
    """The owner of one :class:`BackgroundThread` that works on a lock
    backend: its logger, its backend, and its thread, whose loop is
    :meth:`_serve` (``thread``: the thread's other arguments).
    """

    def __init__(self, backend: B, *, logger: str, **thread: Any) -> None:
        self.logger = get_logger(logger, type(self))
        self.backend = backend
        self._thread = BackgroundThread(loop=self._serve, **thread)

    @abstractmethod
    def _serve(self, thread: BackgroundThread) -> None: ...


class Served(ThreadOwner[B], Generic[B, R, T]):
    """A :class:`ThreadOwner` whose loop waits on the owner's own
    condition, ``_wakeup`` (made by ``_reset``, run again in a forked
    child: what the parent queued is the parent's, and its lock may have
    been held), takes its next work under it (``_next``, None to end)
    and does it outside (``_send``).  A greenlet under gevent: it sends
    with the backend's own client.  ``reports`` is where outcomes go.
    """

    _wakeup: threading.Condition

    def __init__(self, backend: B, *, reports: R, drain_timeout: int, logger: str, name: str) -> None:
        self.reports = reports
        self.drain_timeout = drain_timeout
        self._reset()
        super().__init__(backend, logger=logger, name=name, on_fork=self._reset, on_wake=self._notify)

    @abstractmethod
    def _reset(self) -> None: ...

    @abstractmethod
    def _next(self, thread: BackgroundThread) -> Optional[tuple[Any, ...]]: ...

    @abstractmethod
    def _send(self, *work: Any) -> None: ...

    @abstractmethod
    def drain(self, timeout: Optional[float] = None) -> bool: ...

    @abstractmethod
    def _left_over(self) -> list[T]: ...

    def _notify(self) -> None:
        with self._wakeup:
            self._wakeup.notify_all()

    def _ensure_thread(self) -> None:
        """Start the thread unless it runs; the lock is held.  (The
        hand-off model does the thread's work in its own rules instead.)
        """
        self._thread.ensure_started()

    def _serve(self, thread: BackgroundThread) -> None:
        try:
            while True:
                with self._wakeup:
                    work = self._next(thread)
                    if work is None:
                        thread.retire()  # under the lock: a submission from now on starts a new thread
                        return
                self._send(*work)
        except BaseException:
            with self._wakeup:
                thread.retire()  # the next submission starts a new thread (the base logs the error)
                self._wakeup.notify_all()  # and a drain waiting for this one stops waiting
            raise

    def stop(self, timeout: Optional[float] = None) -> list[T]:
        """Drain, then end the thread.

        Returns:
          list: What is left after ``timeout`` milliseconds (default
          ``drain_timeout``): the releases not sent, and those of the
          batch stuck in flight (it may have been applied), for the
          caller to hand on (:class:`~.worker.resend.OwedReleases`).
        """
        drained = self.drain(timeout)
        # A thread stuck in a call is not waited for again: the drain did.
        self._thread.stop(timeout=min(DEFAULT_STOP_TIMEOUT, timeout or DEFAULT_STOP_TIMEOUT) if drained else 0)
        with self._wakeup:
            return self._left_over()


class OneCall(Generic[T]):
    """One call on a daemon thread of its own, so that its caller can
    stop waiting for it: a call stuck on a silent network (socket
    timeouts and client retries can add up to minutes) holds that
    thread, not its caller.

    Not a :class:`BackgroundThread`: it is one call with a deadline, not
    a loop, so there is nothing to start lazily, stop or drain; a
    greenlet under gevent.

    Parameters:
      call(callable): What to call, with no arguments.
      name(str): The thread's name.
    """

    def __init__(self, call: Callable[[], T], *, name: str) -> None:
        self.done = threading.Event()
        self.value: Optional[T] = None
        self.error: Optional[BaseException] = None
        threading.Thread(target=self._run, args=(call,), name=name, daemon=True).start()

    def _run(self, call: Callable[[], T]) -> None:
        try:
            self.value = call()
        except BaseException as e:  # handed to the waiting thread
            self.error = e
        finally:
            self.done.set()

    def result(self, timeout: float) -> T:
        """What the call returned, waiting at most ``timeout``
        milliseconds.

        Raises:
          TimeoutError: when it has not returned by then.
          BaseException: what the call raised.
        """
        if not self.done.wait(max(timeout, 0) / 1000):
            raise TimeoutError(f"the lock backend did not answer within {max(timeout, 0):.0f} ms")
        if self.error is not None:
            raise self.error
        return cast(T, self.value)


# A worker's shutdown: the deadline of lock calls ------------------------------

#: How often, once the shutdown's deadline for lock calls has passed,
#: the calls still in flight are looked at again, in milliseconds; a
#: call in flight for longer than this is interrupted.
DEFAULT_STUCK_AFTER = 500


class Interruptible:
    """What holds lock calls a shutdown may interrupt: a connection pool
    of lock calls registers itself with :func:`interrupt_at_deadline`.
    """

    def interrupt(self, *, busy_for: float) -> None:  # pragma: no cover - the interface
        """Interrupt every call in flight for longer than ``busy_for``
        milliseconds; it fails as a lost reply does (it may have applied).
        """
        raise NotImplementedError


class _CallsDeadline:
    """The one deadline of this process's lock calls while its worker
    shuts down (see :func:`stop_calls_by`).
    """

    def __init__(self) -> None:
        self.deadline: Optional[float] = None
        self.pid = 0
        self.generation = 0
        self.pools: "weakref.WeakSet[Interruptible]" = weakref.WeakSet()


_CALLS = _CallsDeadline()


def interrupt_at_deadline(pool: Interruptible) -> None:
    """Have ``pool``'s calls interrupted once the shutdown's deadline
    for lock calls has passed.
    """
    _CALLS.pools.add(pool)


def calls_deadline() -> Optional[float]:
    """The monotonic millisecond past which no wait for a lock call of
    this process lasts, while its worker shuts down; None otherwise.
    """
    return _CALLS.deadline if _CALLS.pid == pid() else None


def stop_calls_by(deadline: Optional[float], *, stuck_after: float = DEFAULT_STUCK_AFTER) -> None:
    """From now on no wait for a lock call of this process outlasts
    ``deadline`` (monotonic milliseconds): a group commit's caller stops
    waiting then, and from then on every call in flight for longer than
    ``stuck_after`` ms is interrupted (a silent network would hold it for
    the socket timeout, or for ever on a client that has none).  None
    ends that, when the shutdown is over.
    """
    _CALLS.generation += 1
    _CALLS.deadline, _CALLS.pid = deadline, pid()
    if deadline is None:
        return
    generation = _CALLS.generation

    def watch() -> None:
        mod_time.sleep(max(deadline - now_ms(), 0) / 1000)
        while _CALLS.generation == generation:
            for pool in list(_CALLS.pools):
                pool.interrupt(busy_for=stuck_after)
            mod_time.sleep(stuck_after / 1000)

    threading.Thread(target=watch, name="dramatiq-unique-calls-deadline", daemon=True).start()


_LIVE: "weakref.WeakSet[BackgroundThread]" = weakref.WeakSet()


def _after_fork() -> None:
    global _pid
    _pid = os.getpid()
    JITTER.seed()
    for thread in list(_LIVE):
        thread._forked()


os.register_at_fork(after_in_child=_after_fork)
