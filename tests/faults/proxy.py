"""A loopback TCP proxy that can slow down, blackhole or cut the
connections it carries, for network faults without external tools.

Point a client at ``proxy.port`` instead of the real server; the test
then changes the network under it::

  with Proxy(6379) as proxy:
      client = redis.Redis(port=proxy.port)
      proxy.set_latency(200)   # every chunk waits 200 ms, each way
      proxy.blackhole()        # bytes vanish; sockets stay open
      proxy.cut()              # every connection reset, new ones refused
      proxy.heal()             # back to a plain pipe
      proxy.lose_replies(b"pattern", times=3)  # see lose_replies
"""

from __future__ import annotations

import select
import socket
import struct
import threading
import time
from typing import Optional
from urllib.parse import urlsplit, urlunsplit

#: How much a pump reads at once, in bytes.
CHUNK = 65536

#: How often idle threads look at the proxy's mode, in seconds.
POLL = 0.05


def through(proxy: "Proxy", url: str) -> str:
    """``url`` (a Redis or AMQP URL on 127.0.0.1) with its port replaced
    by the proxy's.
    """
    if url.startswith("amqp"):
        parts = urlsplit(url)
        return urlunsplit(parts._replace(netloc=f"{parts.netloc.rpartition('@')[0]}@127.0.0.1:{proxy.port}"))
    import redis

    kwargs = redis.Redis.from_url(url).connection_pool.connection_kwargs
    return f"redis://127.0.0.1:{proxy.port}/{kwargs.get('db', 0)}"


def _reset(sock: socket.socket) -> None:
    """Close with an RST, the way a dead peer or a firewall looks."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


class Proxy:
    """Forwards ``127.0.0.1:port`` to ``target_host:target_port``.

    Parameters:
      target_port(int): Where connections go.
      target_host(str): The target's address.

    Modes: ``pass`` forwards every byte after ``latency_ms``;
    ``blackhole`` accepts connections and swallows every byte both ways
    while keeping sockets open, like a partition; ``cut`` resets every
    connection and every new one, like a crashed peer.
    """

    def __init__(self, target_port: int, *, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.mode = "pass"
        self.latency_ms = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(POLL)
        self.port: int = self._listener.getsockname()[1]
        self._mutex = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lose: tuple[tuple[bytes, ...], int] = ((), 0)
        self.replies_lost = 0

    # Control ------------------------------------------------------------

    def set_latency(self, latency_ms: int) -> None:
        """Delay every forwarded chunk by ``latency_ms``, each way."""
        self.latency_ms = latency_ms
        self.mode = "pass"

    def blackhole(self) -> None:
        """Swallow all traffic from now on; connections stay open."""
        self.mode = "blackhole"

    def cut(self) -> None:
        """Reset every open connection and refuse new ones."""
        self.mode = "cut"
        with self._mutex:
            doomed, self._sockets = self._sockets, set()
        for sock in doomed:
            _reset(sock)

    def lose_replies(self, *patterns: bytes, times: int) -> None:
        """The next ``times`` requests that contain every one of
        ``patterns`` reach the server, which applies them; their replies
        never reach the client, whose connection is reset instead: a
        call that failed after its send.
        """
        with self._mutex:
            self._lose = (patterns, times)

    def _loses_reply_to(self, chunk: bytes) -> bool:
        with self._mutex:
            patterns, left = self._lose
            if not left or not patterns or not all(p in chunk for p in patterns):
                return False
            self._lose = (patterns, left - 1)
            return True

    def heal(self) -> None:
        """Forward again, with no latency.  Bytes swallowed meanwhile
        stay lost, as on a real network.
        """
        self.latency_ms = 0
        self.mode = "pass"

    # Lifecycle ----------------------------------------------------------

    def start(self) -> "Proxy":
        self._spawn(self._accept)
        return self

    def close(self) -> None:
        self._closed.set()
        self.cut()
        self._listener.close()
        for thread in self._threads:
            thread.join(timeout=2)

    def __enter__(self) -> "Proxy":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Forwarding ---------------------------------------------------------

    def _spawn(self, target: object, *args: object) -> None:
        name = f"proxy-{self.port}"
        thread = threading.Thread(target=target, args=args, daemon=True, name=name)  # type: ignore[arg-type]
        thread.start()
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except (socket.timeout, OSError):
                continue
            if self.mode == "cut":
                _reset(client)
                continue
            try:
                server = socket.create_connection(self.target, timeout=2)
            except OSError:
                _reset(client)
                continue
            self._track(client, server)
            lost = threading.Event()  # set: the server's next reply is dropped, and the client reset
            self._spawn(self._pump, client, server, lost, True)
            self._spawn(self._pump, server, client, lost, False)

    def _track(self, *socks: socket.socket) -> None:
        with self._mutex:
            for sock in socks:
                sock.settimeout(None)
                self._sockets.add(sock)

    def _pump(self, source: socket.socket, sink: socket.socket, lost: threading.Event, upstream: bool) -> None:
        while not self._closed.is_set():
            chunk = self._read(source)
            if chunk is None:
                continue
            if not chunk:
                break
            if self.latency_ms:
                time.sleep(self.latency_ms / 1000)
            if self.mode == "blackhole":
                continue
            if not upstream and lost.is_set():
                self.replies_lost += 1
                break  # the reply is dropped: both ends are reset
            if upstream and self._loses_reply_to(chunk):
                lost.set()
            if not self._write(sink, chunk):
                break
        self._drop(source, sink)

    def _read(self, source: socket.socket) -> Optional[bytes]:
        """A chunk, None when nothing came yet, b"" when the connection
        is gone.
        """
        try:
            readable, _, _ = select.select([source], [], [], POLL)
            return source.recv(CHUNK) if readable else None
        except (OSError, ValueError):  # ValueError: closed by cut()
            return b""

    def _write(self, sink: socket.socket, chunk: bytes) -> bool:
        try:
            sink.sendall(chunk)
            return True
        except OSError:
            return False

    def _drop(self, *socks: socket.socket) -> None:
        with self._mutex:
            live = [sock for sock in socks if sock in self._sockets]
            self._sockets.difference_update(live)
        for sock in live:
            _reset(sock)
