"""The package's background threads on one base (:class:`BackgroundThread`; see
docs/reliability.md, "Green threads (gevent)", "One life cycle"), with the clock, the jitter
and the process id they read.  It imports nothing of the package but ``compat``, so every
module may use it.
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
    """Monotonic ms, for this process's deadlines; never stored in the backend (server or wall time)."""
    return mod_time.monotonic() * 1000


#: The package's jitter and tokens: its own generator, never moving the global ``random`` an
#: application (or Hypothesis, which warns) draws from; reseeded in a forked child, out of step.
JITTER = random.Random()

#: This process's id without ``os.getpid``'s system call, read per job; refreshed in a forked child.
_pid = os.getpid()


def pid() -> int:
    return _pid

#: How long, in ms, :meth:`BackgroundThread.stop` waits for the loop to end.
DEFAULT_STOP_TIMEOUT = 5_000

#: How often, in ms, a bounded wait looks again: short for a drain, long enough to let greenlets run.
DEFAULT_POLL = 10

T = TypeVar("T")

#: A background thread's loop: called with its thread, it returns once ``thread.stopping`` is set.
Loop = Callable[["BackgroundThread"], None]


class Wakeup:
    """An auto-reset event on one plain lock (an OS lock for a native thread, so that no gevent
    primitive crosses the thread boundary); the side that sets it never blocks.
    """

    def __init__(self, lock: Any) -> None:
        self._lock = lock
        self._lock.acquire()  # held: the next wait blocks until set()

    def set(self) -> None:
        try:
            self._lock.release()
        except RuntimeError:  # set already, not waited for yet
            pass

    def wait(self, timeout: float) -> bool:
        """Wait at most ``timeout`` ms; True when it was set."""
        return bool(self._lock.acquire(True, max(timeout, 0) / 1000))


class BackgroundThread:
    """One background thread of a process, running ``loop`` (a :data:`Loop`, which waits with :meth:`wait`).

    ``native`` (a bool, or a callable asked at each start) says whether the loop runs on an OS thread
    under gevent; ``on_fork`` is called in a forked child, to drop what the parent's thread had under
    way; ``on_wake`` by :meth:`wake` and :meth:`stop`, to notify the owner's condition when the loop
    waits on that rather than with :meth:`wait`.
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
        #: The newest generation that ended or was retired, no longer owning the running mark.
        self._retired = 0
        self._reset()
        _LIVE.add(self)

    def _reset(self) -> None:
        #: The process whose thread runs the loop, or None: read per job, cheaper than ``is_alive()``.
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
            # Only while it owns the mark: else a newer thread's, whose clearing would let a third start.
            if self._retired != generation and self.generation == generation:
                self._clear(generation)

    def retire(self) -> None:
        """Give up the newest thread's running mark now: the next :meth:`ensure_started` starts a new
        one.  By a loop, under its owner's lock, as it decides to end (so a later submission never
        finds it still marked), or by the owner giving up on a thread stuck in a call.
        """
        if self.generation != self._retired:
            self._clear(self.generation)

    def _clear(self, generation: int) -> None:
        # Not under the start lock, which would block a native thread on a greenlet's lock.  No start
        # comes between the caller's check and these writes: it waits for the mark, cleared last.
        self._retired = generation
        self._finished = True
        self.running_in = None

    def _stopped_by(self, error: Exception) -> None:
        # Its own function: ``error`` is unbound after its except clause, before the hub runs this.
        self.report(lambda: self.logger.error(
            "%s stopped on an error; the next use starts it again.", self.name, exc_info=error))

    def wake(self) -> None:
        """Have the loop look again now, without blocking."""
        self._wakeup.set()
        if self.on_wake is not None:
            self.on_wake()

    def wait(self, timeout: float) -> bool:
        """In the loop: sleep until :meth:`wake`, :meth:`stop` or ``timeout`` ms; True when woken."""
        return self._wakeup.wait(timeout)

    def stop(self, *, timeout: float = DEFAULT_STOP_TIMEOUT) -> bool:
        """Ask the loop to end and wait for it, at most ``timeout`` ms; True when it ended (or never ran)."""
        self.stopping = True
        self.wake()
        thread = self._thread
        if thread is not None and not self.native:
            if thread is not threading.current_thread():
                thread.join(timeout=timeout / 1000)
            return not thread.is_alive()
        # Never joined, which would block the hub on an OS lock: looked at with sleeps, which yield.
        deadline = now_ms() + timeout
        while not self._finished:
            left = deadline - now_ms()
            if left <= 0:
                return False
            mod_time.sleep(min(left, DEFAULT_POLL) / 1000)
        return True

    def report(self, call: Callable[[], None]) -> None:
        """Run ``call`` where it may touch patched state (on the hub from a native thread); log errors."""
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
    """Owns a logger, a lock backend and a :class:`BackgroundThread` looping :meth:`_serve`."""

    def __init__(self, backend: B, *, logger: str, **thread: Any) -> None:
        self.logger = get_logger(logger, type(self))
        self.backend = backend
        self._thread = BackgroundThread(loop=self._serve, **thread)

    @abstractmethod
    def _serve(self, thread: BackgroundThread) -> None: ...


class Served(ThreadOwner[B], Generic[B, R, T]):
    """A :class:`ThreadOwner` whose loop takes work (``_next``, None to end) under its own condition
    ``_wakeup`` (made by ``_reset``, again in a forked child), and does it outside (``_send``).  A
    greenlet under gevent: it sends with the backend's own client.
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
        """Start the thread unless it runs; the lock is held.  (The hand-off model overrides it.)"""
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
                self._wakeup.notify_all()  # a waiting drain stops
            raise

    def stop(self, timeout: Optional[float] = None) -> list[T]:
        """Drain, then end the thread; return what is left after ``timeout`` ms (``drain_timeout``), the
        batch stuck in flight too (it may have applied), to hand on (:class:`~.worker.resend.OwedReleases`).
        """
        drained = self.drain(timeout)
        # A thread stuck in a call is not waited for again: the drain did.
        self._thread.stop(timeout=min(DEFAULT_STOP_TIMEOUT, timeout or DEFAULT_STOP_TIMEOUT) if drained else 0)
        with self._wakeup:
            return self._left_over()


class OneCall(Generic[T]):
    """One call on a daemon thread of its own, so that a call stuck on a silent network (socket
    timeouts and retries add up to minutes) holds that thread, not its caller.  One call, no
    loop, so no :class:`BackgroundThread`; a greenlet under gevent.
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
        """What the call returned, waiting at most ``timeout`` ms; else TimeoutError, or what the call raised."""
        if not self.done.wait(max(timeout, 0) / 1000):
            raise TimeoutError(f"the lock backend did not answer within {max(timeout, 0):.0f} ms")
        if self.error is not None:
            raise self.error
        return cast(T, self.value)


# A worker's shutdown: the deadline of lock calls ------------------------------

#: Past the shutdown's deadline, lock calls in flight longer than this (ms) are interrupted; looked at as often.
DEFAULT_STUCK_AFTER = 500


class Interruptible:
    """Lock calls a shutdown may interrupt: a pool registers with :func:`interrupt_at_deadline`."""

    def interrupt(self, *, busy_for: float) -> None:  # pragma: no cover - the interface
        """Interrupt every call in flight over ``busy_for`` ms; it fails as a lost reply (may have applied)."""
        raise NotImplementedError


class _CallsDeadline:
    """The deadline of this process's lock calls while its worker shuts down (:func:`stop_calls_by`)."""

    def __init__(self) -> None:
        self.deadline: Optional[float] = None
        self.pid = 0
        self.generation = 0
        self.pools: "weakref.WeakSet[Interruptible]" = weakref.WeakSet()


_CALLS = _CallsDeadline()


def interrupt_at_deadline(pool: Interruptible) -> None:
    """Have ``pool``'s calls interrupted once the shutdown's deadline for lock calls has passed."""
    _CALLS.pools.add(pool)


def calls_deadline() -> Optional[float]:
    """While the worker shuts down, the monotonic ms no wait for a lock call outlasts; else None."""
    return _CALLS.deadline if _CALLS.pid == pid() else None


def stop_calls_by(deadline: Optional[float], *, stuck_after: float = DEFAULT_STUCK_AFTER) -> None:
    """From now on no wait for a lock call outlasts ``deadline`` (monotonic ms), and past it every call
    in flight over ``stuck_after`` ms is interrupted (a silent network would hold it for the socket
    timeout, or for ever).  None ends that, when the shutdown is over.
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
