"""A small threaded HTTP server for the dashboard, from ``wsgiref``."""

from __future__ import annotations

import socket
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer
from wsgiref.simple_server import make_server as wsgiref_server

#: Where ``dramatiq-unique dashboard`` listens by default: this machine
#: only, since without a password the dashboard has no authentication.
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8642

#: The host names of this machine, allowed in the ``Host`` header when
#: the server listens on a loopback address.
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "[::1]"})


class ThreadingServer(ThreadingMixIn, WSGIServer):
    """One thread per request, so a slow backend call blocks no one else."""

    daemon_threads = True


class ThreadingServerV6(ThreadingServer):
    address_family = socket.AF_INET6


#: The listings the page polls every few seconds: their successful
#: requests are not logged, or the log would get a line every 5 s per
#: open page.
POLLED_PATHS = ("/api/view", "/api/locks")


class AccessLogHandler(WSGIRequestHandler):
    """Logs one line per request, like ``wsgiref``, but for the page's own successful refreshes."""

    def log_request(self, code: Any = "-", size: Any = "-") -> None:
        path = self.path.split("?", 1)[0]
        if self.command == "GET" and str(code).startswith("2") and path in POLLED_PATHS:
            return
        super().log_request(code, size)


class QuietHandler(WSGIRequestHandler):
    """Logs no line per request."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


def make_server(app: Any, *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, quiet: bool = False) -> WSGIServer:
    """Bind a server for ``app``; port 0 picks a free port.

    Parameters:
      quiet(bool): Log no request at all; else every request but the page's own refreshes.

    Returns:
      WSGIServer: call ``serve_forever()`` on it, and ``shutdown()``
      from another thread to stop it.
    """
    server_class = ThreadingServerV6 if ":" in host else ThreadingServer
    handler_class = QuietHandler if quiet else AccessLogHandler
    return wsgiref_server(host, port, app, server_class=server_class, handler_class=handler_class)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is an address of this machine only."""
    return host in ("localhost", "::1") or host.startswith("127.")


def serve(app: Any, *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> None:
    """Serve ``app`` until interrupted."""
    with make_server(app, host=host, port=port) as server:
        server.serve_forever()
