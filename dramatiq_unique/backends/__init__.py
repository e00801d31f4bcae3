"""Lock backends: :class:`StubBackend`, :class:`RedisBackend` (the
``redis`` extra), ``PostgresBackend`` (the ``postgres`` extra); other code
makes one with :func:`from_url` or :func:`for_broker`, never importing its module.
"""

from __future__ import annotations

import importlib
import warnings
from types import ModuleType
from typing import Any, Optional

from ..errors import ConfigurationError
from ..settings import POSTGRES_URL_SCHEMES, REDIS_URL_SCHEMES, check_backend_url
from .base import LockBackend
from .stub import StubBackend

__all__ = ["StubBackend", "RedisBackend", "from_url", "for_broker"]

#: Each optional backend by module and extra: driver import, its name for users, URL schemes.
_EXTRAS = {
    "redis": ("redis", "redis-py", REDIS_URL_SCHEMES),
    "postgres": ("psycopg", "psycopg", POSTGRES_URL_SCHEMES),
}


def _module(extra: str) -> ModuleType:
    """The backend module of ``extra``, imported on first use; a missing
    driver raises :class:`ConfigurationError` naming the extra to install.
    """
    driver, name, schemes = _EXTRAS[extra]
    try:
        return importlib.import_module(f"{__name__}.{extra}")
    except ModuleNotFoundError as e:
        if e.name is not None and not e.name.startswith((driver, f"{__name__}.{extra}")):
            raise  # something else is broken: say what
        where = f"{', '.join(schemes[:-1])} or {schemes[-1]}"
        raise ConfigurationError(
            f"a lock backend at {where} URLs needs {name}: pip install 'dramatiq-unique[{extra}]'"
        ) from None


def from_url(url: str, **options: Any) -> LockBackend:
    """Make a lock backend from ``url``, by its scheme, ``options`` passed
    to its constructor: ``redis://``, ``rediss://``, ``unix://``,
    ``redis+cluster://`` make a ``RedisBackend``, ``postgresql://`` and
    ``postgres://`` a ``PostgresBackend``.

    Raises:
      ConfigurationError: naming ``url=``, for a URL that is not one or of
        no backend's scheme; or naming the extra its driver needs.
    """
    url = check_backend_url("url=", url)
    if url.startswith(POSTGRES_URL_SCHEMES):
        backend: LockBackend = _module("postgres").PostgresBackend.from_url(url, **options)
        return backend
    redis_backend: LockBackend = _module("redis").RedisBackend(url=url, **options)
    return redis_backend


def for_broker(broker: Any, **options: Any) -> Optional[LockBackend]:
    """The backend a broker lends when no URL is set: a ``RedisBroker``'s
    client (``RedisBackend(**options)``), a ``StubBroker``'s memory, or None.
    """
    from dramatiq.brokers.stub import StubBroker

    client = getattr(broker, "client", None)
    if type(broker).__name__ == "RedisBroker" and client is not None:
        return _module("redis").RedisBackend(client=client, **options)  # type: ignore[no-any-return]
    if isinstance(broker, StubBroker):
        return StubBackend()
    return None


#: The backends this package names lazily: class -> its extra.
_LAZY = {"RedisBackend": "redis"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        return getattr(_module(_LAZY[name]), name)
    except ConfigurationError as e:  # pragma: no cover
        warnings.warn(str(e), category=ImportWarning, stacklevel=2)
        raise AttributeError(str(e)) from None
