"""A small lock dashboard: a WSGI app to mount, or to run with ``dramatiq-unique dashboard``.

It lists and filters locks, shows holders with deadlines counting down, and releases a lock or one
holder after a confirmation; standard library only, nothing from a CDN.

Warning:
  Without a password (``dramatiq_unique_dashboard_password``) it has no authentication: anyone who
  can reach it can release any lock under its prefix.  Set one, mount it behind yours, or bind it to
  127.0.0.1 (the command's default).

Examples:
  >>> from dramatiq_unique.backends import from_url
  >>> from dramatiq_unique.dashboard import make_app
  >>> app = make_app(from_url("redis://127.0.0.1:6379/0"), prefix="dramatiq-unique")
"""

from __future__ import annotations

from .app import CSRF_HEADER, DEFAULT_LIMIT, Dashboard, make_app
from .server import serve

__all__ = ["CSRF_HEADER", "DEFAULT_LIMIT", "Dashboard", "make_app", "serve"]
