"""The Dramatiq internals this package uses, imported from one place: they are not public API, and
some differ between the Dramatiq versions supported (1.17+ and 2.x).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, NamedTuple, Optional

import dramatiq
from dramatiq.asyncio import async_to_sync
from dramatiq.middleware import age_limit as age_limit_module  # its current_millis: AgeLimit's clock, which tests patch
from dramatiq.middleware.prometheus import Prometheus

try:  # Dramatiq 2.x
    from dramatiq.worker import ConsumerThread
except ImportError:  # Dramatiq 1.x
    from dramatiq.worker import _ConsumerThread as ConsumerThread  # type: ignore[attr-defined,no-redef]

#: The installed Dramatiq, as ``(major, minor)``.
DRAMATIQ_VERSION = tuple(int(part) for part in dramatiq.__version__.split(".")[:2])

#: The logger of Dramatiq's worker threads (same name in 1.x and 2.x), which logs ``SKIPPED_MESSAGE_LOG``
#: at WARNING for every skipped delivery; ``worker.take.QuietSkips`` recognises that text by identity.
WORKER_THREAD_LOGGER = "dramatiq.worker.WorkerThread"
SKIPPED_MESSAGE_LOG = "Message %s was skipped."


# Dramatiq's private state ------------------------------------------------
#
# Each function below is the one place that reaches into Dramatiq where no public way exists.  Each
# was read in, and is run by the suite on, Dramatiq 1.17.1 and 2.2.1; if a later Dramatiq renames
# what it reads, its fallback leaves the feature off (or uses public state) rather than fail a send.


class RedisDispatch(NamedTuple):
    """What the send fast path calls of a ``RedisBroker`` to run its ``dispatch.lua`` itself:
    ``broker._dispatch("enqueue")`` (what ``do_enqueue`` resolves to), ``_should_do_maintenance(command)``
    (the 1-in-N lottery) and ``_max_unpack_size()`` (the Lua unpack limit).
    """

    enqueue: Callable[..., Any]
    maintenance: Callable[[str], int]
    max_unpack_size: Callable[[], int]


def redis_dispatch(broker: Any) -> Optional[RedisDispatch]:
    """The ``RedisBroker`` internals the fast path calls; None when any is missing (two-step send)."""
    dispatch = getattr(broker, "_dispatch", None)
    maintenance = getattr(broker, "_should_do_maintenance", None)
    max_unpack_size = getattr(broker, "_max_unpack_size", None)
    if not (callable(dispatch) and callable(maintenance) and callable(max_unpack_size)):
        return None
    return RedisDispatch(dispatch("enqueue"), maintenance, max_unpack_size)


def replace_broker_enqueue(broker: Any, enqueue: Callable[..., Any]) -> None:
    """Make ``enqueue`` the broker's: every sender (``send_with_options``, Retries, the delay-queue
    move, pipelines, callbacks) looks it up on the instance.  An assignment cannot fail: no fallback.
    """
    broker.enqueue = enqueue


def replace_redis_do_enqueue(broker: Any, do_enqueue: Callable[..., Any]) -> None:
    """Make ``do_enqueue`` the ``RedisBroker``'s: an instance attribute wins over its ``__getattr__``."""
    broker.do_enqueue = do_enqueue


def replace_actor_fn(actor: Any, fn: Callable[..., Any]) -> None:
    """Make ``fn`` what ``actor`` runs (``Actor.__call__`` calls ``self.fn``, for async actors too)."""
    actor.fn = fn


def proxied_message(message: Any) -> Any:
    """The ``Message`` behind a ``MessageProxy``, read without its Python-level ``__getattr__``; the
    fallback, the proxy itself, reads the same values more slowly.
    """
    return getattr(message, "_message", message)


def result_options(results: Any, broker: Any, message: Any) -> tuple[bool, int]:
    """Whether a ``Results`` middleware stores ``message``'s result, and for how long
    (``Results._lookup_options``).  The fallback applies the same rule from public state.
    """
    lookup = getattr(results, "_lookup_options", None)
    if callable(lookup):
        found: tuple[bool, int] = lookup(broker, message)
        return found
    try:
        actor = broker.get_actor(message.actor_name)
    except dramatiq.ActorNotFound:
        return False, 0
    store = message.options.get("store_results", actor.options.get("store_results", results.store_results))
    ttl = message.options.get("result_ttl", actor.options.get("result_ttl", results.result_ttl))
    return store, ttl


def redis_consumer_backoff(consumer: Any) -> Optional[int]:
    """A Redis consumer's longest backoff between polls, in ms (``_RedisConsumer.timeout``).  None for
    other consumers, or none found (the fallback: no quick polling after a hand-off).
    """
    if type(consumer).__name__ != "_RedisConsumer":
        return None
    timeout = getattr(consumer, "timeout", None)
    return timeout if isinstance(timeout, int) else None


def set_redis_consumer_backoff(consumer: Any, cap: int) -> None:
    """Set what :func:`redis_consumer_backoff` reads, capping the consumer's next backoff."""
    consumer.timeout = cap


# gevent ------------------------------------------------------------------
#
# Under ``dramatiq-gevent`` a thread is a greenlet on the hub's OS thread, which cannot run while
# another blocks the hub (a C call, a CPU loop); so what must run then (lease renewal) runs on a real
# OS thread made from gevent's saved originals (public since gevent 1.1; ``run_callback_threadsafe``
# since 20.12, with a fallback).


def threads_are_green() -> bool:
    """Whether gevent patched ``threading`` or ``socket``; gevent is not imported if it is not loaded."""
    if "gevent" not in sys.modules:
        return False
    monkey = sys.modules.get("gevent.monkey")
    if monkey is None:
        return False
    patched: Callable[[str], bool] = monkey.is_module_patched
    return patched("threading") or patched("socket")


def original(module: str, name: str) -> Any:
    """The unpatched ``module.name``: gevent's saved original, else the module's own."""
    if threads_are_green():
        from gevent import monkey

        return monkey.get_original(module, name)
    return getattr(__import__(module), name)


def start_native_thread(target: Callable[[], None]) -> None:
    """Run ``target`` on a new OS thread, even under gevent's patches."""
    original("_thread", "start_new_thread")(target, ())


def native_lock() -> Any:
    """An OS lock, even under gevent: for a native thread's own waits, never a greenlet's."""
    return original("_thread", "allocate_lock")()


def hub_caller() -> Callable[[Callable[[], None]], None]:
    """Called on the thread whose hub should run them: runs callables on that hub from any OS thread
    (at once when threads are not green).
    """
    if not threads_are_green():
        return lambda call: call()
    import gevent

    loop = gevent.get_hub().loop
    run_threadsafe = getattr(loop, "run_callback_threadsafe", None)
    if run_threadsafe is None:  # gevent before 20.12: no way onto the hub from another thread
        return lambda call: call()
    return lambda call: run_threadsafe(call)  # type: ignore[no-any-return]


#: The names re-exported from Dramatiq; the functions above are this module's own.
__all__ = ["ConsumerThread", "Prometheus", "age_limit_module", "async_to_sync"]


# redis-py ----------------------------------------------------------------
#
# The lock calls use redis-py's public connection methods only; what differs between the versions CI
# runs (4.6 to 8.x, with and without hiredis, on Python 3.9 and 3.11+) is handled here.


def timeout_in_disguise(error: BaseException) -> bool:
    """Whether a redis-py ``ConnectionError`` was really a socket timeout.

    redis-py 5.x to 7.x's hiredis parser raises the built-in ``TimeoutError`` on a read timeout, and
    the connection wraps every ``OSError`` but ``socket.timeout`` in a ``ConnectionError``.  Up to
    Python 3.9 the two differ, so a silent server looks like a dropped connection, which retry
    policies resend after each timeout (seen: 2 to 8 s instead of one 0.5 s timeout).  The error it was
    raised from tells them apart; a real drop has no timeout behind it, so no fallback is needed.
    """
    import socket

    cause = error.__cause__ or error.__context__
    return isinstance(cause, (socket.timeout, TimeoutError))
