"""Cheap script calls on a standalone Redis, :class:`~.client.RedisBackend`'s
lock I/O: one pre-encoded ``EVALSHA`` per call on a small private pool that
mirrors the client's connections, and :class:`GroupCommit`, which lets worker
threads share round trips (docs/architecture.md, "The Redis lock I/O").
"""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Any, Callable, Optional, Sequence, Union

import redis
from redis.backoff import FullJitterBackoff
from redis.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.exceptions import NoScriptError, ResponseError
from redis.retry import Retry

from ...background import DEFAULT_STUCK_AFTER, Interruptible, calls_deadline, interrupt_at_deadline, now_ms, pid
from ...compat import timeout_in_disguise

#: The seconds a caller waits for another thread's round trip, without a socket timeout.
DEFAULT_TIMEOUT = 30.0

#: How often, in seconds, a waiting caller looks at the shutdown's deadline.
SLICE = 0.1

RoundTrip = Callable[[list[tuple[Any, ...]]], list[Any]]


class _Caller:
    """One caller's commands, and where its replies land."""

    __slots__ = ("commands", "trailer", "replies", "error", "ready", "leads")

    def __init__(self, commands: list[tuple[Any, ...]], trailer: Optional[tuple[Any, ...]] = None) -> None:
        self.commands = commands
        self.trailer = trailer
        self.replies: Optional[list[Any]] = None
        self.error: Optional[BaseException] = None
        self.ready = threading.Lock()
        self.ready.acquire()  # released once: replies in, or the lead handed over
        self.leads = False

    def result(self) -> list[Any]:
        if self.error is not None:
            raise self.error
        assert self.replies is not None
        return self.replies


_INTERRUPTED = "the worker's shutdown interrupted this lock call; it may have applied"


def _interrupted(interrupt: BaseException) -> TimeoutError:
    """A lost reply, not the interrupt, for the others in a round trip its leader's interrupt broke."""
    return TimeoutError(
        f"the round trip carrying this call was interrupted in another thread ({interrupt!r}); "
        "the call may have applied"
    )


class GroupCommit:
    """Shares round trips between concurrent callers.

    Parameters:
      round_trip(callable): Sends commands in one round trip, returns replies.
      timeout(float): The most seconds a caller waits for another thread's round trip.
    """

    def __init__(self, round_trip: RoundTrip, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.round_trip = round_trip
        self.timeout = timeout
        self._mutex = threading.Lock()
        self._queue: list[_Caller] = []
        self._leading = False
        self._pid = pid()

    def call(self, commands: list[tuple[Any, ...]], *, trailer: Optional[tuple[Any, ...]] = None) -> list[Any]:
        """Send ``commands`` in the next round trip and return their replies,
        then ``trailer``'s: a command sent once after all callers' commands
        (``WAIT`` covers every write before it on the connection).
        """
        with self._mutex:
            if self._pid != pid():
                self._queue, self._leading, self._pid = [], False, pid()  # the parent's round trip is not ours
            leads = not self._leading
            self._leading = True
            if not leads:
                caller = _Caller(commands, trailer)
                self._queue.append(caller)
        if leads:
            # Nobody is queued (a caller only queues behind a lead).
            try:
                return self.round_trip(commands if trailer is None else [*commands, trailer])
            finally:
                self._hand_over([])
        try:
            if not self._wait(caller):
                raise TimeoutError(
                    f"the lock backend did not answer within {self.timeout:.0f} s, or before the worker's "
                    "shutdown deadline; the call may have applied"
                )
        except BaseException:  # a time limit's exception too: never leave the lead with nobody
            self._abandon(caller)
            raise
        if caller.leads:  # handed the lead: send what queued meanwhile, this caller's own included
            self._lead(caller)
        return caller.result()

    def _wait(self, caller: _Caller) -> bool:
        """Wait for ``caller``'s replies (or the lead) at most ``timeout`` s,
        never past a shutdown's deadline, but ``DEFAULT_STUCK_AFTER`` ms at
        least: as long as a call in flight is left before it is broken.
        """
        end, began = time.monotonic() + self.timeout, now_ms()
        while True:
            left = end - time.monotonic()
            stop = calls_deadline()
            if stop is not None:
                left = min(left, (max(stop, began + DEFAULT_STUCK_AFTER) - now_ms()) / 1000)
            if left <= 0:
                return caller.ready.acquire(blocking=False)
            if caller.ready.acquire(timeout=min(left, SLICE)):
                return True

    def _abandon(self, caller: _Caller) -> None:
        """Take back a caller that stops waiting: out of the queue, its lead passed on."""
        with self._mutex:
            if caller in self._queue:
                self._queue.remove(caller)
            if not caller.leads:
                return
            following = self._queue[0] if self._queue else None
            if following is None:
                self._leading = False
            else:
                following.leads = True
        if following is not None:
            following.ready.release()

    def _lead(self, leader: _Caller) -> None:
        """Send all queued in one round trip, hand out the replies, pass the lead on."""
        with self._mutex:
            batch, self._queue = self._queue, []
        # Each distinct trailer once, after every caller's commands.
        trailers = list(dict.fromkeys(caller.trailer for caller in batch if caller.trailer is not None))
        try:
            replies = self.round_trip([command for caller in batch for command in caller.commands] + trailers)
        except BaseException as e:  # a time limit's exception too: every caller must hear of it
            for caller in batch:
                caller.error = e if caller is leader or isinstance(e, Exception) else _interrupted(e)
        else:
            at, ends = 0, dict(zip(trailers, replies[len(replies) - len(trailers) :]))
            for caller in batch:
                caller.replies, at = replies[at : at + len(caller.commands)], at + len(caller.commands)
                if caller.trailer is not None:
                    caller.replies.append(ends[caller.trailer])
        finally:
            self._hand_over(batch)

    def _hand_over(self, batch: list[_Caller]) -> None:
        with self._mutex:
            following = self._queue[0] if self._queue else None
            if following is None:
                self._leading = False
            else:
                following.leads = True
        for caller in batch:
            if not caller.leads:
                caller.ready.release()
        if following is not None:
            following.ready.release()


def as_text(value: Any) -> str:
    """A reply as text: redis-py answers bytes unless told to decode."""
    return value.decode() if isinstance(value, bytes) else str(value)


#: One script call: script name, keys, arguments.
Call = tuple[str, Sequence[Union[str, bytes]], Sequence[Union[str, bytes, int]]]

_MIRRORED = (Connection, SSLConnection, UnixDomainSocketConnection)
_EVALSHA = b"EVALSHA"

#: How often a lock call whose connection failed is resent on a fresh one,
#: where the client names no retry policy: redis-py gives a client from a
#: URL (the broker's too) none, so one dropped connection would fail a
#: send or leave a key held.  Never after a timeout, which it would multiply.
DEFAULT_RETRIES = 3


class _Retry(Retry):
    """Retries failed connections, never timeouts, even disguised as one (``timeout_in_disguise``)."""

    def call_with_retry(self, do: Callable[[], Any], fail: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return super().call_with_retry(lambda: _unmasked(do), fail, *args, **kwargs)


def _unmasked(do: Callable[[], Any]) -> Any:
    """``do()``, a timeout raised as a ``ConnectionError`` raised as ``TimeoutError``."""
    try:
        return do()
    except redis.ConnectionError as e:
        if timeout_in_disguise(e):
            raise redis.TimeoutError(str(e)) from e
        raise


def default_retry() -> Retry:
    """:data:`DEFAULT_RETRIES`, after at most 20, 40, 80 ms (full jitter): safe, as scripts survive lost replies."""
    return _Retry(FullJitterBackoff(cap=1.0, base=0.01), DEFAULT_RETRIES, supported_errors=(redis.ConnectionError,))


def _with_retry(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Connection parameters, with :func:`default_retry` where they name none."""
    if kwargs.get("retry") is not None or kwargs.get("retry_on_error") or kwargs.get("retry_on_timeout"):
        return kwargs
    return {**kwargs, "retry": default_retry()}


def _pack_in_python(command: tuple[Any, ...]) -> bytes:
    """One command in RESP, as redis-py packs str, int and bytes (all the scripts take)."""
    parts = [b"*%d\r\n" % len(command)]
    for arg in command:
        if isinstance(arg, str):
            arg = arg.encode()
        elif isinstance(arg, int):
            arg = b"%d" % arg
        parts.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(parts)


def _packer() -> Callable[[tuple[Any, ...]], bytes]:
    """hiredis's packer, in C, where installed; the same bytes in Python otherwise."""
    try:
        from hiredis import pack_command
    except ImportError:  # pragma: no cover - without hiredis
        return _pack_in_python
    return pack_command  # type: ignore[no-any-return]


_pack = _packer()


def _group_timeout(client: Any) -> float:
    """Long enough for another thread's round trip to time out and be retried once."""
    timeout = client.connection_pool.connection_kwargs.get("socket_timeout")
    return DEFAULT_TIMEOUT if not timeout else 2 * timeout + 1


def _mirrorable(client: Any) -> bool:
    pool: Any = getattr(client, "connection_pool", None)
    return (
        type(client) is redis.Redis
        and type(pool) in (redis.ConnectionPool, redis.BlockingConnectionPool)
        and pool.connection_class in _MIRRORED
        and getattr(pool, "cache", None) is None
        and pool.connection_kwargs.get("encoding", "utf-8").lower().replace("-", "") == "utf8"
        # A single-connection client keeps its own ``client.connection``.
        and getattr(client, "connection", None) is None
    )


class ScriptCalls(Interruptible):
    """Calls Lua scripts (``sources``: name -> Lua source) by SHA1 on ``client``.

    Parameters:
      client(redis.Redis): A standalone client, whose connection parameters
        and retry policy (or :func:`default_retry`) are used.
      group_commit(bool): False sends each grouped call in its own round
        trip (to measure what the group commit buys).
    """

    def __init__(self, client: Any, sources: dict[str, str], *, group_commit: bool = True) -> None:
        self.client = client
        self.sources = sources
        self.shas = {name: hashlib.sha1(source.encode()).hexdigest().encode() for name, source in sources.items()}
        self.direct = _mirrorable(client)
        self._adding = threading.Lock()
        self._idle: list[Any] = []
        self._pid = pid()
        grouping = self.direct and group_commit
        self._group = GroupCommit(self._round_trip, timeout=_group_timeout(client)) if grouping else None
        #: Connections in a round trip: id -> (connection, monotonic ms it began).
        self._busy: dict[int, tuple[Any, float]] = {}
        #: Bumped by each interrupt: a round trip it broke is not sent again.
        self._interrupts = 0
        interrupt_at_deadline(self)

    # Connections ----------------------------------------------------

    def _take(self) -> Any:
        if self._pid != pid():
            # Forked: the parent's sockets are not ours to use.
            self._idle, self._busy, self._pid = [], {}, pid()
        try:
            conn = self._idle.pop()
        except IndexError:
            pool = self.client.connection_pool
            return pool.connection_class(**_with_retry(pool.connection_kwargs))
        # As redis-py's pool: an idle connection with data to read was
        # closed by the server; reconnect while that is safe (a client from
        # a URL does not retry).  Idle ones last succeeded: this never connects.
        try:
            if conn.can_read():
                conn.disconnect()
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            conn.disconnect()
        return conn

    def _give(self, conn: Any) -> None:
        if conn.pid == self._pid:
            self._idle.append(conn)

    def add(self, name: str, source: str) -> None:
        """Make script ``name`` callable; safe beside calls, which look in ``sources``, set last."""
        with self._adding:  # two names added at once: neither is lost
            self.shas = {**self.shas, name: hashlib.sha1(source.encode()).hexdigest().encode()}
            self.sources = {**self.sources, name: source}

    def close(self) -> None:
        """Disconnect the idle connections."""
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.disconnect()

    def _exchange(self, conn: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
        """One round trip; error replies returned, not raised; timeouts as :func:`_unmasked`."""
        packed = b"".join(map(_pack, commands))
        replies: list[Any] = _unmasked(lambda: self._send_and_read(conn, packed, len(commands)))
        return replies

    @staticmethod
    def _send_and_read(conn: Any, packed: bytes, count: int) -> list[Any]:
        conn.send_packed_command([packed])
        replies: list[Any] = []
        for _ in range(count):
            try:
                replies.append(conn.read_response())
            except ResponseError as e:
                replies.append(e)
        return replies

    def _round_trip(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        if not self.direct:
            return self._through_client(commands)
        conn = self._take()
        interrupts = self._interrupts

        def attempt() -> list[Any]:
            # A round trip that a shutdown broke (see interrupt) is not sent again.
            if interrupts != self._interrupts:
                raise redis.TimeoutError(_INTERRUPTED)
            return self._exchange(conn, commands)

        self._busy[id(conn)] = (conn, now_ms())
        try:
            result: list[Any] = conn.retry.call_with_retry(attempt, lambda _error: conn.disconnect())
        except BaseException as e:
            # Whatever broke the exchange (a time limit too) may have left replies unread: never reuse it.
            conn.disconnect()
            if isinstance(e, Exception) and interrupts != self._interrupts:
                # A shutdown broke it from another thread (redis-py's parser
                # then raises ValueError, hiredis a lost connection): it may have applied.
                raise redis.TimeoutError(_INTERRUPTED) from e
            raise
        finally:
            self._busy.pop(id(conn), None)
        self._give(conn)
        return result

    def interrupt(self, *, busy_for: float) -> None:
        """Break, from another thread during a shutdown, every round trip in
        flight for ``busy_for`` ms or more: it fails at once as a lost reply
        (it may have applied), and is not sent again.
        """
        now = now_ms()
        stuck = [conn for conn, since in list(self._busy.values()) if now - since >= busy_for]
        if not stuck:
            return
        self._interrupts += 1
        for conn in stuck:
            try:
                conn.disconnect()
            except Exception:  # a socket closed meanwhile: nothing left to break
                pass

    def _through_client(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        if len(commands) == 1:
            try:
                return [self.client.execute_command(*commands[0])]
            except ResponseError as e:
                return [e]
        pipe = self.client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return list(pipe.execute(raise_on_error=False))

    # Calls ----------------------------------------------------------

    def call(self, name: str, keys: Sequence[Union[str, bytes]], args: Sequence[Union[str, bytes, int]]) -> Any:
        """Run one script and return its reply; raises ``redis.RedisError`` for
        a connection failure that outlived the retries, or an error reply.
        """
        [reply] = self.batch([(name, keys, args)])
        if isinstance(reply, Exception):
            raise reply
        return reply

    def batch(
        self, calls: Sequence[Call], *, grouped: bool = False, trailer: Optional[tuple[Any, ...]] = None
    ) -> list[Any]:
        """Run scripts in one round trip (two after ``NOSCRIPT``): per call,
        its reply or ``ResponseError``, then the trailer's reply or error.

        Parameters:
          grouped(bool): Share the round trip with other threads' grouped
            calls (:class:`GroupCommit`): for the calls every job makes.
          trailer(tuple): A command sent after the scripts on the same
            connection (``WAIT``); grouped, once after all callers' scripts.
        """
        shas = self.shas
        commands = [(_EVALSHA, shas[name], len(keys), *keys, *args) for name, keys, args in calls]
        if grouped and self._group is not None:
            replies = self._group.call(commands, trailer=trailer)
        else:
            replies = self._round_trip(commands if trailer is None else [*commands, trailer])
        for reply in replies:
            if isinstance(reply, NoScriptError):
                return self._reload(calls, commands, replies, trailer)
        return replies

    def _reload(
        self,
        calls: Sequence[Call],
        commands: list[tuple[Any, ...]],
        replies: list[Any],
        trailer: Optional[tuple[Any, ...]] = None,
    ) -> list[Any]:
        """Load the missing scripts, resend the calls that got ``NOSCRIPT``
        (none ran), then the trailer: a ``WAIT`` before did not cover them.
        """
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        loads = [(b"SCRIPT", b"LOAD", self.sources[name]) for name in {calls[i][0] for i in missing}]
        again = self._round_trip(loads + [commands[i] for i in missing] + ([] if trailer is None else [trailer]))
        for error in again[: len(loads)]:
            if isinstance(error, Exception):
                raise error
        for i, reply in zip(missing, again[len(loads) :]):
            replies[i] = reply
        if trailer is not None:
            replies[-1] = again[-1]
        return replies
