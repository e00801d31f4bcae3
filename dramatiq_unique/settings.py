"""Defaults and the one place where environment variables are read.

Variables follow Dramatiq's lower-case ``dramatiq_*`` convention; the
upper-case spelling is read too.  Constructor arguments win over them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Mapping, Optional, TypeVar

from .errors import ConfigurationError

#: The prefix of every lock key.
DEFAULT_PREFIX = "dramatiq-unique"

#: How long a client (enqueue) lock lives, counted from when the
#: message becomes due: 24 hours, in milliseconds.
DEFAULT_LOCK_TTL = 86_400_000

#: The lease of a run lock, in milliseconds.  A renewal thread renews
#: it every lease/3 while the actor runs, so a killed worker frees its
#: key within one lease.
DEFAULT_LEASE = 60_000

#: How long a conflicting message waits before it is tried again, in
#: milliseconds (with +/-20% jitter).
DEFAULT_RESCHEDULE_DELAY = 5_000

#: What to do when the lock backend fails: ``"fail"`` (never run or
#: enqueue without the lock) or ``"run_unlocked"``.
DEFAULT_ON_BACKEND_ERROR = "fail"

BACKEND_ERROR_POLICIES = ("fail", "run_unlocked")

T = TypeVar("T")


@dataclass(frozen=True)
class Settings:
    """The middleware's resolved configuration."""

    redis_url: Optional[str] = None
    prefix: str = DEFAULT_PREFIX
    lock_ttl: int = DEFAULT_LOCK_TTL
    lease: int = DEFAULT_LEASE
    reschedule_delay: int = DEFAULT_RESCHEDULE_DELAY
    enabled: bool = True
    on_backend_error: str = DEFAULT_ON_BACKEND_ERROR

    def merge(self, **overrides: Any) -> "Settings":
        """Return a copy with every override that is not None applied
        and validated.
        """
        given = {name: value for name, value in overrides.items() if value is not None}
        for name, value in given.items():
            _CHECKS[name](f"{name}=", value)
        return replace(self, **given)


def _positive_int(what: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigurationError(f"{what}{value!r} is invalid: expected a positive whole number of milliseconds.")
    return value


def _non_negative_int(what: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(f"{what}{value!r} is invalid: expected a whole number of milliseconds, 0 or more.")
    return value


def _text(what: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigurationError(f"{what}{value!r} is invalid: expected a non-empty string.")
    return value


def _flag(what: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigurationError(f"{what}{value!r} is invalid: expected True or False.")
    return value


def _policy(what: str, value: Any) -> str:
    if value not in BACKEND_ERROR_POLICIES:
        raise ConfigurationError(f"{what}{value!r} is invalid: expected one of {', '.join(BACKEND_ERROR_POLICIES)}.")
    return str(value)


_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "redis_url": _text,
    "prefix": _text,
    "lock_ttl": _positive_int,
    "lease": _positive_int,
    "reschedule_delay": _non_negative_int,
    "enabled": _flag,
    "on_backend_error": _policy,
}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _parse(variable: str, raw: str, field: str) -> Any:
    what = f"Environment variable {variable}="
    if field in ("lock_ttl", "lease", "reschedule_delay"):
        try:
            number = int(raw.strip())
        except ValueError:
            raise ConfigurationError(f"{what}{raw!r} is invalid: expected a whole number of milliseconds.") from None
        return _CHECKS[field](what, number)
    if field == "enabled":
        if raw.strip().lower() not in _TRUE | _FALSE:
            raise ConfigurationError(f"{what}{raw!r} is invalid: expected 1/0 or true/false.")
        return raw.strip().lower() in _TRUE
    return _CHECKS[field](what, raw.strip())


def from_environment(environ: Optional[Mapping[str, str]] = None) -> Settings:
    """Read every ``dramatiq_unique_*`` variable.

    Raises:
      ConfigurationError: naming the variable, when a value is bad.
    """
    environ = os.environ if environ is None else environ
    found: dict[str, Any] = {}
    for field in fields(Settings):
        variable = f"dramatiq_unique_{field.name}"
        for spelling in (variable, variable.upper()):
            raw = environ.get(spelling)
            if raw is not None and raw != "":
                found[field.name] = _parse(spelling, raw, field.name)
                break
    return Settings(**found)
