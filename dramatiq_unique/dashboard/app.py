"""The dashboard's WSGI app: the page, its JSON endpoints, and the checks that keep other sites from
releasing locks.

Release is a JSON ``POST`` with the :data:`CSRF_HEADER` header: another site's page cannot send
either without a CORS preflight, which this app never approves, and an HTML form can send neither.
A browser reporting ``Sec-Fetch-Site`` must report same-origin.  Against DNS rebinding,
``allowed_hosts`` limits the ``Host`` header, and a password (Basic auth) every request but the icon's.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Callable, Collection, Iterable, Mapping, Optional, Sequence
from urllib.parse import parse_qs

from ..backends.base import LockBackend
from ..errors import LockBackendError
from ..ops.admin import PHASES, LockAdmin, UnknownLock
from ..settings import DEFAULT_PREFIX, check_password, from_environment
from . import view

#: How many locks one listing shows at most.
DEFAULT_LIMIT = 500

#: The header, valued ``1``, that every release request must carry; the page's script sets it.
CSRF_HEADER = "X-Dramatiq-Unique"

#: The largest release request body read, in bytes.
MAX_BODY = 16_384

#: The page's assets: path -> (package file, content type); ``/`` is rendered from ``index.html``.
ASSETS = {
    "/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}

#: The icon, at the page's path and at the one browsers try by themselves, so no page load meets a 404.
FAVICON = (
    b'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 32 32">'
    b'<rect width="32" height="32" rx="7" fill="#1d4ed8"/>'
    b'<path d="M11 14.5v-3a5 5 0 0 1 10 0v3" fill="none" stroke="#fff" stroke-width="2.6" stroke-linecap="round"/>'
    b'<rect x="8" y="14" width="16" height="12" rx="2.5" fill="#fff"/>'
    b'<circle cx="16" cy="20" r="2.1" fill="#1d4ed8"/></svg>'
)
FAVICON_PATHS = ("/favicon.svg", "/favicon.ico")

#: The challenge of a request without the password: browsers then ask for it, and send it on.
CHALLENGE = ("WWW-Authenticate", 'Basic realm="dramatiq-unique", charset="UTF-8"')

_SECURITY_HEADERS = [
    ("Cache-Control", "no-store"),
    ("X-Content-Type-Options", "nosniff"),
    ("X-Frame-Options", "DENY"),
    ("Referrer-Policy", "no-referrer"),
    ("Content-Security-Policy", "default-src 'self'; frame-ancestors 'none'; form-action 'none'; base-uri 'none'"),
]

_UNPROTECTED = "This dashboard has no authentication of its own: set a password, or mount it behind yours."

StartResponse = Callable[..., Any]


@dataclass
class Response:
    status: str
    content_type: str
    body: bytes
    headers: list[tuple[str, str]] = field(default_factory=list)


class HTTPError(Exception):
    """Ends a request with ``status`` and a JSON error message."""

    def __init__(self, status: str, message: str, headers: Sequence[tuple[str, str]] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = list(headers)


def _json(status: str, data: Any, headers: Sequence[tuple[str, str]] = ()) -> Response:
    return Response(status, "application/json", json.dumps(data).encode(), list(headers))


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
      allowed_hosts(Collection[str]): Host names the ``Host`` header may carry, or None for any.  Set
        it when the app is reachable on a loopback address, so a DNS-rebinding page cannot use it.
      limit(int): How many locks one listing shows at most.
      password(str): The password every request needs (HTTP Basic auth, any user name); None:
        ``dramatiq_unique_dashboard_password``, and when that is unset, none (mount it behind yours).
    """

    def __init__(
        self,
        admin: LockAdmin,
        *,
        allowed_hosts: Optional[Collection[str]] = None,
        limit: int = DEFAULT_LIMIT,
        password: Optional[str] = None,
    ) -> None:
        password = from_environment().dashboard_password if password is None else check_password("password=", password)
        # Only its digest is kept, and compared: in constant time, whatever the length given.
        self._digest = hashlib.sha256(password.encode()).digest() if password is not None else None
        self.admin = admin
        self.allowed_hosts = {host.lower() for host in allowed_hosts} if allowed_hosts is not None else None
        self.limit = limit
        files = resources.files(__package__)
        self.assets = {path: files.joinpath(name).read_bytes() for path, (name, _) in ASSETS.items()}
        self.template = files.joinpath("index.html").read_text(encoding="utf-8")

    def __call__(self, environ: Mapping[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        try:
            self._check_host(environ)
            self._check_password(environ)
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

    @property
    def protected(self) -> bool:
        return self._digest is not None

    def _check_password(self, environ: Mapping[str, Any]) -> None:
        if self._digest is None or environ.get("PATH_INFO") in FAVICON_PATHS:
            return
        scheme, _, credentials = environ.get("HTTP_AUTHORIZATION", "").partition(" ")
        try:
            given = base64.b64decode(credentials.strip(), validate=True).partition(b":")[2]
        except ValueError:  # not base64
            given = b""
        if not hmac.compare_digest(hashlib.sha256(given).digest(), self._digest) or scheme.lower() != "basic":
            raise HTTPError("401 Unauthorized", "This dashboard needs its password (HTTP Basic auth).", [CHALLENGE])

    def _route(self, environ: Mapping[str, Any]) -> Response:
        path = environ.get("PATH_INFO", "")
        query = view.Query.parse(parse_qs(environ.get("QUERY_STRING", "")))
        if path == "":
            # Mounted at /locks, the page's relative URLs need /locks/.
            location = environ.get("SCRIPT_NAME", "") + "/"
            return Response("301 Moved Permanently", "text/plain", b"", [("Location", location)])
        if path == "/api/release":
            _require(environ, "POST")
            return self._release(environ)
        if path not in ("/", "/api/locks", "/api/view", *ASSETS, *FAVICON_PATHS) and not path.startswith("/api/locks/"):
            raise HTTPError("404 Not Found", f"No page at {path!r}.")
        _require(environ, "GET")
        if path == "/":
            return self._page(query)
        if path in ASSETS:
            return Response("200 OK", ASSETS[path][1], self.assets[path])
        if path in FAVICON_PATHS:
            return Response("200 OK", "image/svg+xml", FAVICON, [("Cache-Control", "max-age=86400")])
        if path == "/api/locks":
            return self._locks(query)
        if path == "/api/view":
            return _json("200 OK", self._view(query))
        locks = self.admin.inspect(path[len("/api/locks/") :])
        return _json("200 OK", {"now": _now_ms(), "locks": [lock.as_dict() for lock in locks]})

    def _listing(self, query: view.Query) -> view.Listing:
        seen: list[dict[str, Any]] = []
        listed = []
        for lock in self.admin.locks(actor=query.actor or None, pattern=query.pattern or None):
            data = lock.as_dict()
            seen.append(data)
            if view.matches(data, query):
                listed.append(data)
                if len(listed) > self.limit:
                    break
        now = _now_ms()
        truncated = len(listed) > self.limit
        return view.sort_locks(listed[: self.limit], query, now), seen, truncated, now

    def _view(self, query: view.Query, *, failed: bool = False) -> dict[str, Any]:
        """The page's fragments for ``query``; with ``failed``, of no locks (the listing failed)."""
        listing = self._listing(query) if not failed else ([], [], False, _now_ms())
        locks, _, truncated, now = listing
        html = view.fragments(listing, query, self.admin.prefix, self.limit)
        return {"now": now, "count": len(locks), "truncated": truncated, "html": html}

    def _page(self, parsed: view.Query) -> Response:
        try:
            data, error = self._view(parsed), ""
        except LockBackendError as e:
            # The page still loads, says why it is empty, and retries.
            data, error = self._view(parsed, failed=True), f"Could not list the locks: {e}"
        footer = "This dashboard asks for its password." if self.protected else _UNPROTECTED
        page = view.page_html(self.template, {**data["html"], "footer": footer}, parsed, data["now"], error=error)
        return Response("200 OK", "text/html; charset=utf-8", page.encode())

    def _locks(self, query: view.Query) -> Response:
        locks, _, truncated, now = self._listing(query)
        data = {"prefix": self.admin.prefix, "now": now, "limit": self.limit, "truncated": truncated, "locks": locks}
        return _json("200 OK", data)

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
    password: Optional[str] = None,
) -> Dashboard:
    """The :class:`Dashboard` of the locks of ``backend`` under ``prefix``; see it for ``password``."""
    return Dashboard(LockAdmin(backend, prefix=prefix), allowed_hosts=allowed_hosts, limit=limit, password=password)
