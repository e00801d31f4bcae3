"""Lock backends: :class:`StubBackend` always, :class:`RedisBackend`
when the ``redis`` extra is installed.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from .stub import StubBackend

__all__ = ["StubBackend", "RedisBackend"]


def __getattr__(name: str) -> Any:
    if name != "RedisBackend":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        return importlib.import_module(f"{__name__}.redis").RedisBackend
    except ModuleNotFoundError:  # pragma: no cover
        message = "RedisBackend needs redis-py. Run `pip install dramatiq-unique[redis]` to add it."
        warnings.warn(message, category=ImportWarning, stacklevel=2)
        raise AttributeError(message) from None
