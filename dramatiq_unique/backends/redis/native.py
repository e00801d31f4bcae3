"""Lease renewals from a native OS thread under gevent
(:class:`~..capabilities.RenewsNatively`): ``extend.lua`` over RESP2 on
an unpatched socket, touching nothing of redis-py's.
"""

from __future__ import annotations

import hashlib
import socket as socket_module
from typing import Any, Optional, Sequence

from ...compat import original


class NativeExtend:
    """A :class:`~..capabilities.NativeExtender`: one ``EVALSHA`` of
    ``extend.lua`` per lock in one write (``EVAL`` after ``NOSCRIPT``).
    Used by one thread at a time.

    Parameters:
      address(tuple or str): ``(host, port)``, or a Unix socket path.
      db(int): The database to select.
      username(str), password(str): For ``AUTH``, when set.
      script(str): The source of ``extend.lua`` (``[key], [owner, ttl]``).
      connect_timeout(float): In seconds.
    """

    def __init__(
        self,
        *,
        address: Any,
        db: int = 0,
        username: Optional[str] = None,
        password: Optional[str] = None,
        script: str,
        connect_timeout: float = 5.0,
    ) -> None:
        self.address = address
        self.db = db
        self.username = username
        self.password = password
        self.script = script.encode()
        self.sha = hashlib.sha1(self.script).hexdigest().encode()
        self.connect_timeout = connect_timeout
        self._sock: Any = None
        self._file: Any = None

    def __call__(self, locks: Sequence[tuple[str, str]], ttl: int, *, timeout: float) -> list[bool]:
        """Extend each ``(key, owner)`` to ``ttl`` ms from now, within ``timeout`` ms.

        Raises:
          TimeoutError: no answer in time; the connection is closed.
          OSError: the connection failed; it is closed.
          RuntimeError: an error reply other than ``NOSCRIPT``.
        """
        if timeout <= 0:
            raise TimeoutError("the lease ran out before it could be renewed")
        try:
            return self._exchange(locks, ttl, timeout / 1000)
        except BaseException:
            self.close()
            raise

    def _exchange(self, locks: Sequence[tuple[str, str]], ttl: int, timeout: float) -> list[bool]:
        if self._sock is None:
            self._connect(min(timeout, self.connect_timeout))
        self._sock.settimeout(timeout)
        calls = [self._evalsha([key], [owner, ttl]) for key, owner in locks]
        replies = self._round_trip(calls)
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, _ErrorReply) and reply.noscript]
        if missing:
            again = self._round_trip([[b"EVAL", self.script, *calls[i][2:]] for i in missing])
            for i, reply in zip(missing, again):
                replies[i] = reply
        for reply in replies:
            if isinstance(reply, _ErrorReply):
                raise RuntimeError(f"the lock backend refused a renewal: {reply.text}")
        return [bool(reply) for reply in replies]

    def _evalsha(self, keys: Sequence[Any], args: Sequence[Any]) -> list[bytes]:
        return [b"EVALSHA", self.sha, str(len(keys)).encode(), *map(_encoded, keys), *map(_encoded, args)]

    def _connect(self, timeout: float) -> None:
        make_socket = original("socket", "socket")
        if isinstance(self.address, str):
            sock = make_socket(socket_module.AF_UNIX, socket_module.SOCK_STREAM)
            target: Any = self.address
        else:
            family, kind, proto, _, target = original("socket", "getaddrinfo")(*self.address, 0, 1)[0]
            sock = make_socket(family, kind, proto)
        sock.settimeout(timeout)
        try:
            sock.connect(target)
        except BaseException:
            sock.close()
            raise
        self._sock, self._file = sock, sock.makefile("rb")
        handshake = []
        if self.password:
            handshake.append([b"AUTH", *([self.username.encode()] if self.username else []), self.password.encode()])
        if self.db:
            handshake.append([b"SELECT", str(self.db).encode()])
        for reply in self._round_trip(handshake) if handshake else []:
            if isinstance(reply, _ErrorReply):
                raise RuntimeError(f"the lock backend refused the renewal connection: {reply.text}")

    def _round_trip(self, commands: list[list[bytes]]) -> list[Any]:
        self._sock.sendall(b"".join(_pack(command) for command in commands))
        return [_read_reply(self._file) for _ in commands]

    def close(self) -> None:
        """Close the connection; the next call opens a new one."""
        sock, file, self._sock, self._file = self._sock, self._file, None, None
        for closable in (file, sock):
            if closable is not None:
                try:
                    closable.close()
                except OSError:
                    pass


class _ErrorReply:
    """A RESP error reply."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.noscript = text.startswith("NOSCRIPT")


def _encoded(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def _pack(command: list[bytes]) -> bytes:
    return b"*%d\r\n" % len(command) + b"".join(b"$%d\r\n%s\r\n" % (len(arg), arg) for arg in command)


def _read_reply(file: Any) -> Any:
    line = file.readline()
    if not line.endswith(b"\r\n"):
        raise ConnectionError("the lock backend closed the renewal connection")
    kind, rest = line[:1], line[1:-2]
    if kind == b":":
        return int(rest)
    if kind == b"+":
        return rest
    if kind == b"-":
        return _ErrorReply(rest.decode(errors="replace"))
    if kind == b"$":
        size = int(rest)
        return None if size < 0 else file.read(size + 2)[:-2]
    if kind == b"*":
        size = int(rest)
        return None if size < 0 else [_read_reply(file) for _ in range(size)]
    raise ConnectionError(f"the lock backend sent an unexpected reply: {line[:40]!r}")


def native_extend(client: Any, *, script: str) -> Optional[NativeExtend]:
    """A :class:`NativeExtend` mirroring a standalone ``client``'s plain TCP
    or Unix connection; None for any other (not ours to mirror).
    """
    import redis

    pool = getattr(client, "connection_pool", None)
    if type(pool) is not redis.ConnectionPool or pool.connection_class not in (
        redis.Connection,
        redis.UnixDomainSocketConnection,
    ):
        return None
    kwargs = pool.connection_kwargs
    address = kwargs.get("path") or (kwargs.get("host", "localhost"), int(kwargs.get("port", 6379)))
    return NativeExtend(
        address=address,
        db=int(kwargs.get("db", 0) or 0),
        username=kwargs.get("username"),
        password=kwargs.get("password"),
        script=script,
        connect_timeout=float(kwargs.get("socket_connect_timeout") or 5.0),
    )
