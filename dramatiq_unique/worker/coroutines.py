"""Async actors: a run lock is never released while its coroutine runs.

Dramatiq runs an async actor's coroutine on its event loop thread and
waits for it on the worker thread.  When a time limit interrupts the
worker thread, Dramatiq cancels the coroutine and waits one second for
it; a coroutine that ignores the cancellation goes on running after the
worker thread has moved on and fired the after-hooks.  So each async
actor's coroutine is wrapped, when the actor is declared, to tell the
delivery when it really ends, and a release that comes earlier is
deferred until then, the lease renewed meanwhile.
"""

from __future__ import annotations

import functools
import inspect
import threading
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Callable, Optional

from ..compat import async_to_sync, replace_actor_fn

if TYPE_CHECKING:
    from dramatiq import Actor

#: The watch of the delivery the current worker thread runs; the event
#: loop thread sees it, as Dramatiq copies the worker's context there.
_current: ContextVar[Optional["CoroutineWatch"]] = ContextVar("dramatiq_unique_coroutine", default=None)


class CoroutineWatch:
    """Whether one delivery's coroutine has ended, and what to do then."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._ended = False
        self._then: Optional[Callable[[], None]] = None

    def ended(self) -> None:
        """Called on the event loop thread when the coroutine ends."""
        with self._mutex:
            self._ended, then = True, self._then
        if then is not None:
            # Off the event loop: the deferred release makes a blocking call.
            # A one-off thread, not a BackgroundThread: one call, made
            # rarely (a coroutine that outlived its time limit), with no
            # loop to stop or drain; a greenlet under gevent, like the
            # event loop thread that calls this.
            threading.Thread(target=then, name="dramatiq-unique-late-release", daemon=True).start()

    def defer(self, then: Callable[[], None]) -> bool:
        """Run ``then`` when the coroutine ends, if it has not yet.

        Returns:
          bool: False when it has already ended: the caller goes on now.
        """
        with self._mutex:
            if self._ended:
                return False
            self._then = then
            return True


def watch() -> CoroutineWatch:
    """A watch for the delivery starting on this thread."""
    current = CoroutineWatch()
    _current.set(current)
    return current


def track(actor: "Actor[Any, Any]") -> bool:
    """Wrap an async actor's coroutine so that its delivery's watch
    learns when it ends.  Other actors are left as they are.

    Returns:
      bool: Whether the actor is async, and so tracked.
    """
    if getattr(actor.fn, "_unique_tracked", False):
        return True
    original = getattr(actor.fn, "__wrapped__", None)
    if not inspect.iscoroutinefunction(original):
        return False

    @functools.wraps(original)
    async def tracked(*args: Any, **kwargs: Any) -> Any:
        current = _current.get()
        try:
            return await original(*args, **kwargs)
        finally:
            if current is not None:
                current.ended()

    wrapped = async_to_sync(tracked)
    wrapped._unique_tracked = True  # type: ignore[attr-defined]
    replace_actor_fn(actor, wrapped)
    return True
