"""The dashboard's WSGI app: the page, its JSON endpoints, and the
checks that keep other sites from releasing locks.

Release is a ``POST`` with a JSON body and the :data:`CSRF_HEADER`
header.  Another site's page cannot send a custom header or a JSON
content type without a CORS preflight, which this app never approves,
and an HTML form can send neither.  A browser that reports
``Sec-Fetch-Site`` must also report a same-origin request.  Against DNS
rebinding, ``allowed_hosts`` limits the ``Host`` header.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from importlib import resources
from itertools import islice
from typing import Any, Callable, Collection, Iterable, Mapping, Optional
from urllib.parse import parse_qs

from ..admin import PHASES, LockAdmin, UnknownLock
from ..backend import LockBackend
from ..errors import LockBackendError
from ..settings import DEFAULT_PREFIX

#: How many locks one listing shows at most.
DEFAULT_LIMIT = 500

#: The header, with the value ``1``, that every release request must
#: carry.  The page's script sets it.
CSRF_HEADER = "X-Dramatiq-Unique"

#: The largest release request body read, in bytes.
MAX_BODY = 16_384

#: The page and its assets: path -> (package file, content type).
ASSETS = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}

_SECURITY_HEADERS = [
    ("Cache-Control", "no-store"),
    ("X-Content-Type-Options", "nosniff"),
    ("X-Frame-Options", "DENY"),
    ("Referrer-Policy", "no-referrer"),
    ("Content-Security-Policy", "default-src 'self'; frame-ancestors 'none'; form-action 'none'; base-uri 'none'"),
]

StartResponse = Callable[..., Any]


@dataclass
class Response:
    status: str
    content_type: str
    body: bytes
    headers: list[tuple[str, str]] = field(default_factory=list)


class HTTPError(Exception):
    """Ends a request with ``status`` and a JSON error message."""

    def __init__(self, status: str, message: str, headers: Optional[list[tuple[str, str]]] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or []


def _json(status: str, data: Any, headers: Optional[list[tuple[str, str]]] = None) -> Response:
    return Response(status, "application/json", json.dumps(data).encode(), headers or [])


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _host_name(host: str) -> str:
    """The ``Host`` header without its port; IPv6 keeps its brackets."""
    if host.startswith("["):
        return host[: host.find("]") + 1].lower()
    return host.rsplit(":", 1)[0].lower()


class Dashboard:
    """The lock dashboard as a WSGI application.

    Parameters:
      admin(LockAdmin): What the dashboard shows and releases.
      allowed_hosts(Collection[str]): Host names the ``Host`` header
        may carry, or None for any.  Set it when the app is reachable
        on a loopback address, so a DNS-rebinding page cannot use it.
      limit(int): How many locks one listing shows at most.

    Warning:
      It has no authentication of its own.  Mount it behind yours.
    """

    def __init__(
        self, admin: LockAdmin, *, allowed_hosts: Optional[Collection[str]] = None, limit: int = DEFAULT_LIMIT
    ) -> None:
        self.admin = admin
        self.allowed_hosts = {host.lower() for host in allowed_hosts} if allowed_hosts is not None else None
        self.limit = limit
        files = resources.files(__package__)
        self.assets = {path: files.joinpath(name).read_bytes() for path, (name, _) in ASSETS.items()}

    def __call__(self, environ: Mapping[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        try:
            self._check_host(environ)
            response = self._route(environ)
        except HTTPError as e:
            response = _json(e.status, {"error": e.message}, e.headers)
        except UnknownLock as e:
            response = _json("404 Not Found", {"error": str(e)})
        except LockBackendError as e:
            response = _json("503 Service Unavailable", {"error": str(e)})
        headers = [("Content-Type", response.content_type), ("Content-Length", str(len(response.body)))]
        start_response(response.status, headers + _SECURITY_HEADERS + response.headers)
        return [response.body]

    def _check_host(self, environ: Mapping[str, Any]) -> None:
        if self.allowed_hosts is None:
            return
        host = _host_name(environ.get("HTTP_HOST") or environ.get("SERVER_NAME", ""))
        if host not in self.allowed_hosts:
            raise HTTPError("400 Bad Request", f"Host {host!r} is not allowed.")

    def _route(self, environ: Mapping[str, Any]) -> Response:
        path = environ.get("PATH_INFO", "")
        if path == "":
            # Mounted at /locks, the page's relative URLs need /locks/.
            location = environ.get("SCRIPT_NAME", "") + "/"
            return Response("301 Moved Permanently", "text/plain", b"", [("Location", location)])
        if path in ASSETS:
            _require(environ, "GET")
            return Response("200 OK", ASSETS[path][1], self.assets[path])
        if path == "/api/locks":
            _require(environ, "GET")
            return self._locks(parse_qs(environ.get("QUERY_STRING", "")))
        if path.startswith("/api/locks/"):
            _require(environ, "GET")
            locks = self.admin.inspect(path[len("/api/locks/") :])
            return _json("200 OK", {"now": _now_ms(), "locks": [lock.as_dict() for lock in locks]})
        if path == "/api/release":
            _require(environ, "POST")
            return self._release(environ)
        raise HTTPError("404 Not Found", f"No page at {path!r}.")

    def _locks(self, query: Mapping[str, list[str]]) -> Response:
        actor = (query.get("actor") or [""])[0].strip() or None
        pattern = (query.get("pattern") or [""])[0].strip() or None
        locks = list(islice(self.admin.locks(actor=actor, pattern=pattern), self.limit + 1))
        return _json(
            "200 OK",
            {
                "prefix": self.admin.prefix,
                "now": _now_ms(),
                "limit": self.limit,
                "truncated": len(locks) > self.limit,
                "locks": [lock.as_dict() for lock in locks[: self.limit]],
            },
        )

    def _release(self, environ: Mapping[str, Any]) -> Response:
        _check_same_origin(environ)
        body = _read_json(environ)
        digest, holder, phase = body.get("digest"), body.get("holder"), body.get("phase")
        if not isinstance(digest, str) or not isinstance(holder, (str, type(None))) or phase not in (None, *PHASES):
            raise HTTPError("400 Bad Request", 'Expected {"digest": str, "holder": str?, "phase": "queue"|"run"?}.')
        released = self.admin.release(digest, holder=holder, phase=phase)
        if not released:
            raise HTTPError("404 Not Found", "Nothing was released: the lock or holder was already gone.")
        return _json("200 OK", {"released": released})


def _require(environ: Mapping[str, Any], method: str) -> None:
    if environ.get("REQUEST_METHOD") != method:
        raise HTTPError("405 Method Not Allowed", f"Use {method}.", [("Allow", method)])


def _check_same_origin(environ: Mapping[str, Any]) -> None:
    """Refuse a release that a page of another site could have sent."""
    if environ.get("HTTP_" + CSRF_HEADER.upper().replace("-", "_")) != "1":
        raise HTTPError("403 Forbidden", f"A release request must carry the header {CSRF_HEADER}: 1.")
    if environ.get("HTTP_SEC_FETCH_SITE", "same-origin") != "same-origin":
        raise HTTPError("403 Forbidden", "A release request must come from the dashboard's own page.")
    if not environ.get("CONTENT_TYPE", "").startswith("application/json"):
        raise HTTPError("415 Unsupported Media Type", "A release request must have a JSON body.")


def _read_json(environ: Mapping[str, Any]) -> dict[str, Any]:
    try:
        length = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        raise HTTPError("400 Bad Request", "Invalid Content-Length.") from None
    if length > MAX_BODY:
        raise HTTPError("413 Payload Too Large", f"A release request body has at most {MAX_BODY} bytes.")
    try:
        body = json.loads(environ["wsgi.input"].read(length) or b"null")
    except ValueError:
        raise HTTPError("400 Bad Request", "The body is not JSON.") from None
    if not isinstance(body, dict):
        raise HTTPError("400 Bad Request", "The body must be a JSON object.")
    return body


def make_app(
    backend: LockBackend,
    *,
    prefix: str = DEFAULT_PREFIX,
    allowed_hosts: Optional[Collection[str]] = None,
    limit: int = DEFAULT_LIMIT,
) -> Dashboard:
    """Build the dashboard for the locks of ``backend`` under ``prefix``.

    Parameters:
      backend(LockBackend): Where the locks live.
      prefix(str): The prefix the middleware was given.
      allowed_hosts(Collection[str]): Host names the ``Host`` header may
        carry, or None for any.
      limit(int): How many locks one listing shows at most.

    Returns:
      Dashboard: a WSGI application.

    Warning:
      The dashboard has no authentication of its own.  Mount it behind
      your own, e.g. a reverse proxy or your web framework's admin.
    """
    return Dashboard(LockAdmin(backend, prefix=prefix), allowed_hosts=allowed_hosts, limit=limit)
