"""One round trip on a redis-py connection, written and read by hand.

redis-py's ``send_packed_command`` and ``read_response`` wrap a
``sendall`` and a hiredis reader in several layers of Python, which
cost a loaded worker more than the round trip itself.  Here each socket
of a connection gets a hiredis reader and a poller of its own, and a
round trip is one ``sendall`` and, usually, one ``recv``.  What redis-py
does around them is kept: the connection connects (handshake included)
and health-checks itself, socket errors become the same exceptions, a
broken exchange disconnects, and error replies are redis-py's own
classes, by its own parser's table.

Only RESP2 connections with hiredis installed are read here; the
connection's own parser reads every other (see :func:`readable_by_us`).
"""

from __future__ import annotations

import _socket
import select
import socket
import ssl
import struct
import sys
import time
from typing import Any

import redis
from redis.exceptions import InvalidResponse, ResponseError


def _reader_class() -> Any:
    try:
        from hiredis import Reader
    except ImportError:  # pragma: no cover - without hiredis
        return None
    return Reader


#: hiredis's reader class, where installed.
_Reader = _reader_class()

#: The most bytes one read takes off the socket.
READ_SIZE = 65536

#: Where a socket's timeout can live in the kernel as a ``timeval``.
_KERNEL_TIMEOUTS = sys.platform.startswith(("linux", "darwin", "freebsd"))


def readable_by_us(client: Any) -> bool:
    """Whether :func:`exchange` can read this client's connections: with
    hiredis, on RESP2.
    """
    kwargs = client.connection_pool.connection_kwargs
    return _Reader is not None and kwargs.get("protocol", 2) in (2, "2", None)


class _Socket:
    """What we keep for one socket of a connection: a new socket (a
    reconnection) gets a new, empty reader.
    """

    __slots__ = ("sock", "reader", "poller", "timeout_placed")

    def __init__(self, conn: Any) -> None:
        self.sock = conn._sock
        self.reader: Any = None if _Reader is None else _Reader(
            protocolError=InvalidResponse, replyError=conn._parser.parse_error
        )
        self.poller = select.poll()
        self.poller.register(self.sock.fileno(), select.POLLIN)
        # Whether the first exchange has placed the timeout: a socket
        # that redis-py reads (RESP3, no hiredis) keeps its own, and
        # its own errors.
        self.timeout_placed = False


def _timeout_in_kernel(sock: Any) -> None:
    """Move a plain socket's timeout into the kernel (see the module's
    docstring).  TLS sockets, which read records of their own, keep it,
    and so do gevent's and eventlet's, which are no ``_socket.socket``:
    they wait in their hub, where only their own timeout counts.
    """
    timeout = sock.gettimeout()
    if not (timeout and _KERNEL_TIMEOUTS and isinstance(sock, _socket.socket)) or isinstance(sock, ssl.SSLSocket):
        return
    seconds = int(timeout)
    # A zero timeval is no timeout at all: a timeout under a microsecond takes one.
    micros = max(int((timeout - seconds) * 1_000_000), 0 if seconds else 1)
    timeval = struct.pack("ll", seconds, micros)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    sock.settimeout(None)


def _socket_of(conn: Any) -> _Socket:
    ours = getattr(conn, "_unique_socket", None)
    if ours is None or ours.sock is not conn._sock:
        ours = conn._unique_socket = _Socket(conn)
    return ours  # type: ignore[no-any-return]


def readable(conn: Any) -> bool:
    """Whether an idle connection has anything to read, which means the
    server closed it: one ``poll`` system call on a plain socket, where
    redis-py's ``can_read`` makes three; TLS sockets, which may hold
    records of their own, ask the connection.
    """
    sock = conn._sock
    if sock is None:
        return False
    if isinstance(sock, ssl.SSLSocket):
        return bool(conn.can_read())
    return bool(_socket_of(conn).poller.poll(0))


def exchange(conn: Any, packed: bytes, count: int) -> list[Any]:
    """Send ``packed``, ``count`` commands, and read their replies: a
    Redis error reply is returned in its place, an error redis-py would
    retry (``LOADING``, say) is raised.
    """
    if conn._sock is None:
        conn.connect()
    if conn.health_check_interval and time.monotonic() > conn.next_health_check:
        _check_health(conn)
    ours = _socket_of(conn)
    if not ours.timeout_placed:
        _timeout_in_kernel(ours.sock)
        ours.timeout_placed = True
    try:
        ours.sock.sendall(packed)
        replies = _read(ours, count)
    except (socket.timeout, BlockingIOError):  # BlockingIOError: a kernel timeout ran out
        conn.disconnect()
        raise redis.TimeoutError(f"Timeout on the lock backend at {_where(conn)}") from None
    except OSError as e:
        conn.disconnect()
        raise redis.ConnectionError(f"Error on the lock backend at {_where(conn)}: {e!r}") from None
    if conn.health_check_interval:
        conn.next_health_check = time.monotonic() + conn.health_check_interval
    return replies


def _check_health(conn: Any) -> None:
    """redis-py's health check, which reads the socket itself, with the
    connection's Python-level timeout back in place: on a socket timed
    in the kernel a silent server would fail it as ``EAGAIN``, which
    redis-py raises as a ``ConnectionError``, retried (each retry waiting
    the timeout again), instead of its ``TimeoutError``.
    """
    sock, ours = conn._sock, getattr(conn, "_unique_socket", None)
    placed = ours is not None and ours.sock is sock and ours.timeout_placed
    if placed:
        sock.settimeout(conn.socket_timeout)
    try:
        conn.check_health()
    finally:
        if placed and conn._sock is sock:
            sock.settimeout(None)


def _read(ours: _Socket, count: int) -> list[Any]:
    reader = ours.reader
    replies: list[Any] = []
    while len(replies) < count:
        chunk = ours.sock.recv(READ_SIZE)
        if not chunk:
            raise redis.ConnectionError("Connection closed by server.")
        reader.feed(chunk)
        reply = reader.gets()
        while reply is not False:  # RESP2 has no false: False means the rest is still on its way
            if isinstance(reply, Exception) and not isinstance(reply, ResponseError):
                raise reply
            replies.append(reply)
            reply = reader.gets()
    return replies


def _where(conn: Any) -> str:
    return str(getattr(conn, "path", "") or f"{getattr(conn, 'host', '?')}:{getattr(conn, 'port', '?')}")
