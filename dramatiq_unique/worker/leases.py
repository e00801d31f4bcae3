"""Keeps the run leases of one worker process alive.

One daemon thread per process renews every held lease every lease/3
at most, in one round trip with every other lease due within half an
interval, so that a process's leases align and share their renewals.
A lease is lost when the backend says its owner no longer holds it, or
when renewals have failed until the lease's last known deadline has
passed.  A lost lease is reported once and never silently treated as
held.

Timeline of a lost lease, with a 60 s lease::

  t=0    worker A takes the lease (deadline t=60 on the server)
  t=20   renewal fails: Redis unreachable, or silent (a renewal that
         gets no answer is abandoned at the deadline, never awaited
         past it); A retries every second
  t=60   still failing: A's deadline has passed, so A reports the
         lease lost (ERROR log, ``lock_lost`` event); another worker
         may take the key from now on
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from dramatiq.logging import get_logger

from ..backends.base import LockBackend
from ..background import DEFAULT_STOP_TIMEOUT, BackgroundThread
from ..clock import now_ms
from ..compat import original
from ..forks import pid

#: How soon a failed renewal is tried again, in milliseconds.
RETRY_INTERVAL = 1_000


class _Renewal:
    """One ``extend`` call on a daemon thread, so the keeper can stop
    waiting for it: a call stuck on a silent network (socket timeouts
    and client retries can add up to minutes) must not outlive the
    leases it renews.

    Not a :class:`~..background.BackgroundThread`: it is one call with a
    deadline, not a loop, so there is nothing to start lazily, stop or
    drain, and the keeper (which is one) refuses a new renewal while an
    abandoned one still waits.  Used only when renewals run through the
    backend's own client: under gevent that is a greenlet, on a backend
    with no native connection.
    """

    def __init__(self, extend: Callable[[], list[bool]]) -> None:
        self.done = threading.Event()
        self.held: list[bool] = []
        self.error: Optional[BaseException] = None
        threading.Thread(target=self._run, args=(extend,), name="dramatiq-unique-renewal", daemon=True).start()

    def _run(self, extend: Callable[[], list[bool]]) -> None:
        try:
            self.held = extend()
        except BaseException as e:
            self.error = e
        finally:
            self.done.set()

    def result(self, timeout: float) -> list[bool]:
        """The answer, waiting at most ``timeout`` milliseconds."""
        if not self.done.wait(max(timeout, 0) / 1000):
            raise TimeoutError(f"the lock backend did not answer within {max(timeout, 0):.0f} ms")
        if self.error is not None:
            raise self.error
        return self.held


@dataclass(eq=False)
class Lease:
    """A run lease held by this process."""

    key: str
    owner: str
    actor: str
    expires_at: float
    renew_at: float
    lost: bool = False


class LeaseKeeper:
    """Renews leases of ``lease`` milliseconds on ``backend``.

    Under gevent's monkey-patching the keeper runs on a native OS
    thread, with a connection of its own on an unpatched socket
    (:class:`NativeExtend`), so that a lease is renewed while its actor
    holds the hub in a C call or a CPU loop; what it reports (a lost
    lease, a failed renewal, its logs) runs on the hub.  A backend with
    no such connection (the in-memory one, a Cluster, TLS, Sentinel)
    renews on a greenlet, as before, and says so once.

    Parameters:
      backend(LockBackend): Where the leases live.
      lease(int): The lease, in milliseconds.
      on_lost(callable): Called once with each lost :class:`Lease`.
      on_error(callable): Called with each :class:`Lease` whose
        renewal failed because the backend did.
    """

    def __init__(
        self,
        backend: LockBackend,
        *,
        lease: int,
        on_lost: Callable[[Lease], None],
        on_error: Optional[Callable[[Lease], None]] = None,
    ) -> None:
        self.logger = get_logger(__name__, type(self))
        self.backend = backend
        self.lease = lease
        self.on_lost = on_lost
        self.on_error = on_error
        self._leases: dict[int, Lease] = {}
        self._renewal: Optional[_Renewal] = None
        self._native_extend: Optional[NativeExtend] = None
        self._thread = BackgroundThread(
            name="dramatiq-unique-leases", loop=self._serve, native=self._can_renew_natively, on_fork=self._forked
        )

    def _forked(self) -> None:
        # The parent's connection and renewal belong to the parent.
        self._renewal, self._native_extend = None, None

    def _can_renew_natively(self) -> bool:
        """Called at each start under gevent: find a native connection."""
        if self._native_extend is None:
            self._native_extend = native_extend(self.backend)
        if self._native_extend is None:
            self.logger.warning(
                "gevent patched threads, and %s gives no connection for a native thread: leases renew on the hub, "
                "and an actor that blocks it for longer than the lease loses its lease.", self.backend.describe()
            )
        return self._native_extend is not None

    def hold(self, key: str, owner: str, taken_at: float, *, actor: str = "") -> Lease:
        """Start renewing a lease taken at monotonic ``taken_at`` ms."""
        lease = Lease(key, owner, actor, taken_at + self.lease, taken_at + self.lease / 3)
        # One dict store, atomic on its own: worker threads register and
        # drop a lease per job without contending for a lock.  A new
        # lease falls due after every one held, so the keeper's wait
        # needs no wake-up.
        self._leases[id(lease)] = lease
        if self._thread.running_in != pid():
            self._thread.ensure_started()
        return lease

    def drop(self, lease: Lease) -> None:
        """Stop renewing ``lease``."""
        self._leases.pop(id(lease), None)

    def count(self, actor: Optional[str] = None) -> int:
        """How many leases this process holds, for one actor or all."""
        return sum(1 for lease in self._held() if actor in (None, lease.actor))

    @property
    def native(self) -> bool:
        """Whether renewals run on a native OS thread (gevent only)."""
        return self._thread.native and self._thread.running_in == pid()

    def _held(self) -> list[Lease]:
        # A copy made in one call: the dict may change while it is read.
        return list(self._leases.values())

    def stop(self, *, timeout: float = DEFAULT_STOP_TIMEOUT) -> None:
        """Stop the renewal thread, waiting at most ``timeout`` ms; held
        leases then run out.
        """
        self._thread.stop(timeout=timeout)
        if self._native_extend is not None:
            self._native_extend.close()

    def _serve(self, thread: BackgroundThread) -> None:
        while not thread.stopping:
            now = now_ms()
            held = self._held()
            following = min((lease.renew_at for lease in held), default=None)
            if following is None or following > now:
                thread.wait(max(self.lease / 3 if following is None else following - now, 1))
                continue
            # Leases taken at different times fall due at different
            # times: renew with the first every lease due within half an
            # interval, so that they align and share one round trip.
            # Renewing early is safe; it only moves the deadline later.
            self.renew([lease for lease in held if lease.renew_at <= now + self.lease / 6])

    def renew(self, due: list[Lease]) -> None:
        """Renew ``due`` leases now, in one round trip."""
        started = now_ms()
        try:
            held = self._extend(due)
        except Exception as e:
            self._failed(due, e)
            return
        for lease, still_held in zip(due, held):
            if still_held:
                lease.expires_at = started + self.lease
                lease.renew_at = started + self.lease / 3
            else:
                self._lose(lease)

    def _failed(self, due: list[Lease], error: Exception) -> None:
        self._report(lambda: self.logger.warning("Could not renew %d lease(s): %r. Trying again.", len(due), error))
        for lease in due:
            if self.on_error is not None:
                self._report(lambda lease=lease: self.on_error(lease))  # type: ignore[misc]
            lease.renew_at = min(now_ms() + RETRY_INTERVAL, lease.expires_at)
            if now_ms() >= lease.expires_at:
                self._lose(lease)

    def _extend(self, due: list[Lease]) -> list[bool]:
        """Extend ``due`` leases, waiting for the answer no later than
        the first of their deadlines.
        """
        locks = [(lease.key, lease.owner) for lease in due]
        timeout = min(lease.expires_at for lease in due) - now_ms()
        if self._thread.native and self._native_extend is not None:
            # On this native thread, its own socket times the wait.
            return self._native_extend(locks, self.lease, timeout=timeout)
        if self._renewal is not None and not self._renewal.done.is_set():
            raise TimeoutError("an earlier renewal is still waiting for the lock backend")
        self._renewal = _Renewal(lambda: self.backend.extend(locks, self.lease))
        return self._renewal.result(timeout)

    def _lose(self, lease: Lease) -> None:
        if self._leases.pop(id(lease), None) is None:
            return
        lease.lost = True
        self._report(lambda: self.on_lost(lease))

    def _report(self, call: Callable[[], None]) -> None:
        if self._thread.native:
            self._thread.report(call)
        else:
            call()  # on the keeper's own thread, as before: its errors reach the loop


# A connection for a native thread ------------------------------------------


class NativeExtend:
    """``extend`` on a connection of its own, made with the original
    (unpatched) socket module, for the keeper's native thread under
    gevent: a greenlet-patched socket or pool lock must not be used from
    another OS thread.  It sends the backend's own ``extend.lua``, one
    ``EVALSHA`` per lock in one write (``EVAL`` after a ``NOSCRIPT``),
    and reads RESP2 replies.  Used by one thread at a time.

    Parameters:
      address(tuple or str): ``(host, port)``, or a Unix socket path.
      db(int): The database to select.
      username(str), password(str): For ``AUTH``, when set.
      script(str): The source of ``extend.lua``
        (:meth:`~..backends.redis.RedisBackend.extend_script`).
      call(callable): ``(key, owner, ttl)`` -> the script's keys and
        arguments (:meth:`~..backends.redis.RedisBackend.extend_call`).
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
        call: Callable[[str, str, int], tuple[Sequence[Any], Sequence[Any]]],
        connect_timeout: float = 5.0,
    ) -> None:
        self.address = address
        self.db = db
        self.username = username
        self.password = password
        self.script = script.encode()
        self.sha = hashlib.sha1(self.script).hexdigest().encode()
        self.call = call
        self.connect_timeout = connect_timeout
        self._sock: Any = None
        self._file: Any = None

    def __call__(self, locks: Sequence[tuple[str, str]], ttl: int, *, timeout: float) -> list[bool]:
        """Extend each ``(key, owner)`` to ``ttl`` ms from now, waiting at
        most ``timeout`` ms for the whole exchange.

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
        calls = [self._evalsha(*self.call(key, owner, ttl)) for key, owner in locks]
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
            import socket as socket_module

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


def native_extend(backend: LockBackend) -> Optional[NativeExtend]:
    """A :class:`NativeExtend` for ``backend``'s Redis, when it is a
    standalone :class:`~..backends.redis.RedisBackend` on a plain TCP or
    Unix connection; None otherwise (the caller renews as before).
    """
    if type(backend).__name__ != "RedisBackend" or getattr(backend, "cluster", True):
        return None
    import redis

    pool = getattr(backend.client, "connection_pool", None)  # type: ignore[attr-defined]
    if type(pool) is not redis.ConnectionPool or pool.connection_class not in (
        redis.Connection,
        redis.UnixDomainSocketConnection,
    ):
        return None  # TLS, Sentinel, or a connection of someone's making: not ours to mirror
    kwargs = pool.connection_kwargs
    address = kwargs.get("path") or (kwargs.get("host", "localhost"), int(kwargs.get("port", 6379)))
    return NativeExtend(
        address=address,
        db=int(kwargs.get("db", 0) or 0),
        username=kwargs.get("username"),
        password=kwargs.get("password"),
        script=backend.extend_script(),  # type: ignore[attr-defined]
        call=backend.extend_call,  # type: ignore[attr-defined]
        connect_timeout=float(kwargs.get("socket_connect_timeout") or 5.0),
    )
