"""The Dramatiq internals this package uses, imported from one place.

dramatiq-unique runs on Dramatiq 1.17 and later 1.x, and on 2.x.  The
names below are not part of Dramatiq's public API, and some differ
between those versions; every other module imports them from here.
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

#: The logger of Dramatiq's worker threads, which logs ``"Message %s
#: was skipped."`` at WARNING for every skipped delivery (the same name
#: in 1.x, where the class is ``_WorkerThread``, and in 2.x).
WORKER_THREAD_LOGGER = "dramatiq.worker.WorkerThread"

#: The format of that log record, which :class:`dramatiq_unique.worker.take.QuietSkips`
#: recognises by identity of text, not by a translation of it.
SKIPPED_MESSAGE_LOG = "Message %s was skipped."


# Dramatiq's private state ------------------------------------------------
#
# Each function below is the one place that reaches into an object of
# Dramatiq's with no public way to do what it does.  Each was read in,
# and is run by the suite on, Dramatiq 1.17.1 and 2.2.1, where the names
# are the same; each has a fallback that leaves its feature off (or
# works it out from public state) when a later Dramatiq renames what it
# reads, rather than fail a send or a delivery.


class RedisDispatch(NamedTuple):
    """What the send fast path calls of a ``RedisBroker`` to run its
    ``dispatch.lua`` itself (see :mod:`dramatiq_unique.send.fastpath`).

    Attributes:
      enqueue(callable): ``broker._dispatch("enqueue")``: what the
        broker's ``do_enqueue`` resolves to through its ``__getattr__``.
      maintenance(callable): ``broker._should_do_maintenance(command)``:
        whether this call also runs maintenance (the 1-in-N lottery).
      max_unpack_size(callable): ``broker._max_unpack_size()``: the Lua
        unpack limit the script is passed.
    """

    enqueue: Callable[..., Any]
    maintenance: Callable[[str], int]
    max_unpack_size: Callable[[], int]


def redis_dispatch(broker: Any) -> Optional[RedisDispatch]:
    """The ``RedisBroker`` internals the send fast path calls; None when
    any is missing (the fallback: the usual two-step send).  Checked on
    Dramatiq 1.17.1 and 2.2.1.
    """
    dispatch = getattr(broker, "_dispatch", None)
    maintenance = getattr(broker, "_should_do_maintenance", None)
    max_unpack_size = getattr(broker, "_max_unpack_size", None)
    if not (callable(dispatch) and callable(maintenance) and callable(max_unpack_size)):
        return None
    return RedisDispatch(dispatch("enqueue"), maintenance, max_unpack_size)


def replace_broker_enqueue(broker: Any, enqueue: Callable[..., Any]) -> None:
    """Make ``enqueue`` the broker's ``enqueue``: an instance attribute
    shadows the method, and every sender (``send_with_options``,
    Retries, the worker's delay-queue move, pipelines, callbacks) looks
    ``broker.enqueue`` up on the instance.  Checked on Dramatiq 1.17.1
    and 2.2.1; an attribute assignment cannot fail, so no fallback.
    """
    broker.enqueue = enqueue


def replace_redis_do_enqueue(broker: Any, do_enqueue: Callable[..., Any]) -> None:
    """Make ``do_enqueue`` the ``RedisBroker``'s ``do_enqueue``, which its
    ``enqueue`` calls with the encoded message: an instance attribute
    wins over the broker's ``__getattr__``, which makes one per call
    from ``_dispatch``.  Checked on Dramatiq 1.17.1 and 2.2.1.
    """
    broker.do_enqueue = do_enqueue


def replace_actor_fn(actor: Any, fn: Callable[..., Any]) -> None:
    """Make ``fn`` what ``actor`` runs: ``Actor.__call__`` calls
    ``self.fn`` (an async actor's is already ``async_to_sync`` of its
    coroutine function).  Checked on Dramatiq 1.17.1 and 2.2.1.
    """
    actor.fn = fn


def proxied_message(message: Any) -> Any:
    """The ``Message`` a ``MessageProxy`` stands for (``_message``), whose
    attributes read without the proxy's Python-level ``__getattr__``;
    the fallback is the proxy itself, which reads the same values more
    slowly.  Checked on Dramatiq 1.17.1 and 2.2.1.
    """
    return getattr(message, "_message", message)


def result_options(results: Any, broker: Any, message: Any) -> tuple[bool, int]:
    """Whether ``results`` (a ``Results`` middleware) stores the result of
    ``message``, and for how long: ``Results._lookup_options``.  The
    fallback is the same rule from public state: the message's options,
    then its actor's, then the middleware's ``store_results`` and
    ``result_ttl``; an unknown actor stores nothing.  Checked on
    Dramatiq 1.17.1 and 2.2.1.
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
    """The longest a Redis broker's consumer backs off between polls of
    an empty queue, in ms: ``_RedisConsumer.timeout``, the cap it passes
    ``compute_backoff``.  None for any other consumer, or when it has no
    such cap (the fallback: no quick polling after a hand-off).  Checked
    on Dramatiq 1.17.1 and 2.2.1.
    """
    if type(consumer).__name__ != "_RedisConsumer":
        return None
    timeout = getattr(consumer, "timeout", None)
    return timeout if isinstance(timeout, int) else None


def set_redis_consumer_backoff(consumer: Any, cap: int) -> None:
    """Set what :func:`redis_consumer_backoff` reads; the consumer's next
    backoff is capped by it.
    """
    consumer.timeout = cap


# gevent ------------------------------------------------------------------
#
# Under ``dramatiq-gevent`` the ``threading``, ``_thread``, ``socket`` and
# ``time`` modules are monkey-patched: a thread is a greenlet on the
# hub's OS thread, and a lock, a sleep or a socket yields to the hub.  A
# greenlet cannot run while another blocks the hub (a C call, a CPU
# loop), so what must run then (lease renewal) runs on a real OS thread
# made from gevent's saved originals.  ``gevent.monkey.is_module_patched``
# and ``get_original`` are public since gevent 1.1; the hub's
# ``loop.run_callback_threadsafe`` since gevent 20.12 (checked, with a
# fallback).


def threads_are_green() -> bool:
    """Whether gevent monkey-patched ``threading`` and ``socket`` in this
    process.  gevent is never imported here: a process that did not
    import it cannot have been patched by it.
    """
    if "gevent" not in sys.modules:
        return False
    monkey = sys.modules.get("gevent.monkey")
    if monkey is None:
        return False
    patched: Callable[[str], bool] = monkey.is_module_patched
    return patched("threading") or patched("socket")


def original(module: str, name: str) -> Any:
    """The unpatched ``module.name``: gevent's saved original when the
    module was patched, else the module's own.
    """
    if threads_are_green():
        from gevent import monkey

        return monkey.get_original(module, name)
    return getattr(__import__(module), name)


def start_native_thread(target: Callable[[], None]) -> None:
    """Run ``target`` on a new OS thread, even under gevent's patches."""
    original("_thread", "start_new_thread")(target, ())


def native_lock() -> Any:
    """A lock of the OS, even under gevent's patches: for a native
    thread's own waits, never for a greenlet to wait on.
    """
    return original("_thread", "allocate_lock")()


def hub_caller() -> Callable[[Callable[[], None]], None]:
    """A function that runs a callable on this thread's gevent hub, from
    any OS thread; it calls at once when threads are not green.  Called
    on the thread whose hub should run the callables.
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
# The lock calls use redis-py's public connection methods only
# (``send_packed_command``, ``read_response``, ``can_read``, ``retry``,
# ``connection_pool.connection_class`` / ``connection_kwargs``).  What
# differs between the versions that CI runs (4.6, 5.x, 6.x, 7.x, 8.x,
# each with and without hiredis, on Python 3.9 and 3.11+) is handled here.


def timeout_in_disguise(error: BaseException) -> bool:
    """Whether a redis-py ``ConnectionError`` was really a socket timeout.

    redis-py 5.x to 7.x's hiredis parser raises the built-in
    ``TimeoutError`` when a read times out, and the connection turns
    every ``OSError`` that is not ``socket.timeout`` into a
    ``ConnectionError``.  Up to Python 3.9 the built-in ``TimeoutError``
    is no ``socket.timeout`` (3.10 made them one), so a silent server
    looks like a dropped connection, which retry policies send again
    after each timeout.  The error it was raised from tells the two
    apart.  Checked: the hiredis parsers of redis-py 5.0.8, 5.3.1, 6.4.0,
    7.0.1 and 7.4.1 raise the built-in one (7.1 and later need Python
    3.10, where it is harmless), those of 4.6.0 and 8.1.0 redis-py's own;
    run on Python 3.9.18 with redis-py 7.0.1 and hiredis 3.5.0, where a
    silent server failed as a ``ConnectionError`` after 2.04 to 8.34 s
    before this check and as one ``TimeoutError`` after 0.50 s with it.
    A real dropped connection has no timeout behind it: the check leaves
    it alone on every version, so it needs no fallback.
    """
    import socket

    cause = error.__cause__ or error.__context__
    return isinstance(cause, (socket.timeout, TimeoutError))
