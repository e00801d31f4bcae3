"""Defaults and the one place where environment variables are read (lower-case ``dramatiq_*`` like
Dramatiq's, upper-case too); constructor arguments win over them.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Mapping, Optional
from urllib.parse import urlsplit

from .errors import ConfigurationError

#: The prefix of every lock key.
DEFAULT_PREFIX = "dramatiq-unique"

#: How long an enqueue lock lives, from when the message is due: 24 hours, in milliseconds.
DEFAULT_LOCK_TTL = 86_400_000

#: The lease of a run lock, in ms, renewed every lease/3 while the actor runs: a killed worker frees
#: its key within one lease.
DEFAULT_LEASE = 60_000

#: How long a conflicting message waits before it is tried again, in ms (with +/-20% jitter).
DEFAULT_RESCHEDULE_DELAY = 5_000

#: How long a new enqueue lock holds before its publish is confirmed (then to its full ``lock_ttl``,
#: off the caller's thread), in ms: a producer dying in between frees its key within it.  0: at once.
DEFAULT_PROVISIONAL_WINDOW = 30_000

#: How often, in ms, a worker releases enqueue locks whose message vanished from the Redis broker; 0 never.
DEFAULT_REAP_INTERVAL = 0

#: When the backend fails: ``"fail"`` (never run or enqueue without the lock) or ``"run_unlocked"``.
DEFAULT_ON_BACKEND_ERROR = "fail"

BACKEND_ERROR_POLICIES = ("fail", "run_unlocked")

#: How many replicas must acknowledge each lock a call takes (Redis ``WAIT``); 0 waits for none.
#: See ``docs/reliability.md``, "Failover".
DEFAULT_MIN_REPLICAS = 0

#: How long a lock call waits for those replicas, in milliseconds.
DEFAULT_MIN_REPLICAS_TIMEOUT = 100

#: How long a worker's shutdown waits for lock calls, background and retried releases, confirmations
#: and group-commit waits, in ms; what it could not send is written to the broker for the next worker.
DEFAULT_SHUTDOWN_TIMEOUT = 10_000

#: The most replicas ``min_replicas`` may ask for.
MAX_REPLICAS = 1000

#: The longest duration any setting or option takes, 100 years in ms: durations are added to Unix ms
#: in Lua doubles and Redis expiry times, which lose precision or overflow far beyond it.
MAX_DURATION = 100 * 365 * 86_400_000

#: The URL schemes of the Redis and PostgreSQL lock backends, and every scheme ``from_url`` takes.
REDIS_URL_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://")
POSTGRES_URL_SCHEMES = ("postgresql://", "postgres://")
BACKEND_URL_SCHEMES = REDIS_URL_SCHEMES + POSTGRES_URL_SCHEMES

#: Settings read under a second, older name too: alias -> setting.
ALIASES = {"redis_url": "url"}


@dataclass(frozen=True)
class Settings:
    """The resolved configuration; its repr masks the passwords, so no log leaks them."""

    url: Optional[str] = None
    prefix: str = DEFAULT_PREFIX
    lock_ttl: int = DEFAULT_LOCK_TTL
    lease: int = DEFAULT_LEASE
    reschedule_delay: int = DEFAULT_RESCHEDULE_DELAY
    enabled: bool = True
    on_backend_error: str = DEFAULT_ON_BACKEND_ERROR
    provisional_window: int = DEFAULT_PROVISIONAL_WINDOW
    reap_interval: int = DEFAULT_REAP_INTERVAL
    record_lock_args: bool = False
    min_replicas: int = DEFAULT_MIN_REPLICAS
    min_replicas_timeout: int = DEFAULT_MIN_REPLICAS_TIMEOUT
    shutdown_timeout: int = DEFAULT_SHUTDOWN_TIMEOUT
    dashboard_password: Optional[str] = None

    def __repr__(self) -> str:
        shown = {field.name: getattr(self, field.name) for field in fields(self)}
        shown["url"] = masked(self.url)
        shown["dashboard_password"] = self.dashboard_password and "***"
        return f"Settings({', '.join(f'{name}={value!r}' for name, value in shown.items())})"

    @property
    def redis_url(self) -> Optional[str]:
        """:attr:`url`, under its older name."""
        return self.url

    def merge(self, **overrides: Any) -> "Settings":
        """A copy with every override but None validated and applied; an alias and its setting must agree."""
        given = {name: value for name, value in overrides.items() if value is not None}
        for alias, name in ALIASES.items():
            if alias in given:
                value = _CHECKS[name](f"{alias}=", given.pop(alias))
                if given.get(name, value) != value:
                    raise ConfigurationError(
                        f"{alias}={value!r} is invalid: expected the same as {name}={given[name]!r}, since {alias} "
                        f"is another name for {name}; give one of them."
                    )
                given[name] = value
        for name, value in given.items():
            _CHECKS[name](f"{name}=", value)
        return replace(self, **given)


def is_duration(value: Any, minimum: int) -> bool:
    """Whether ``value`` is a whole number of milliseconds from ``minimum`` to :data:`MAX_DURATION`."""
    return isinstance(value, int) and not isinstance(value, bool) and minimum <= value <= MAX_DURATION


def _whole_number(expected: str, low: int, high: int) -> Callable[[str, Any], int]:
    """The check of a whole number from ``low`` to ``high``; ``expected`` names it in the error."""

    def check(what: str, value: Any) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise ConfigurationError(f"{what}{value!r} is invalid: expected {expected}.")
        return int(value)

    return check


_positive_int = _whole_number(f"a positive whole number of milliseconds, at most {MAX_DURATION}", 1, MAX_DURATION)
_non_negative_int = _whole_number(f"a whole number of milliseconds, 0 or more, at most {MAX_DURATION}", 0, MAX_DURATION)
_replicas = _whole_number(f"a whole number of replicas, 0 to {MAX_REPLICAS}", 0, MAX_REPLICAS)


def _text(what: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigurationError(f"{what}{value!r} is invalid: expected a non-empty string.")
    try:
        value.encode()
    except UnicodeEncodeError:
        # e.g. undecodable bytes in a variable: Redis would refuse the key at every send instead.
        raise ConfigurationError(f"{what}{value!r} is invalid: expected UTF-8 text, without lone surrogates.") from None
    return value


def _prefix(what: str, value: Any) -> str:
    prefix = _text(what, value)
    if "{" in prefix or "}" in prefix:
        raise ConfigurationError(f"{what}{value!r} is invalid: expected no braces, which mark the digest's hash tag.")
    return prefix


def check_backend_url(what: str, value: Any) -> str:
    """``value`` when it is a lock backend URL of a known scheme that its backend can parse.

    Parameters:
      what(str): What the value was given as, for the error, e.g. ``"url="``.

    Raises:
      ConfigurationError: naming ``what``, the value and what was expected.
    """
    url = _text(what, value)
    if not url.startswith(BACKEND_URL_SCHEMES):
        raise ConfigurationError(
            f"{what}{masked(url)!r} is invalid: expected a URL starting with {', '.join(BACKEND_URL_SCHEMES)}."
        )
    postgres = url.startswith(POSTGRES_URL_SCHEMES)
    try:
        _ = urlsplit(url).port  # a port that is no number from 0 to 65535 raises
        _parse_postgres_url(url) if postgres else _parse_redis_url(url)
    except ValueError as e:
        like = "postgresql://user@host:5432/dbname" if postgres else "redis://host:6379/0"
        raise ConfigurationError(
            f"{what}{masked(url)!r} is invalid: {str(e).rstrip('.')}; expected a URL like {like}."
        ) from None
    return url


def masked(url: Optional[str]) -> Optional[str]:
    """``url`` with its password (user part or libpq's ``password=``) shown as ``***``."""
    if url is None:
        return None
    # By pattern, not urlsplit: a URL that does not parse (e.g. "[::1") is shown in an error too.  The
    # last "@" of the netloc ends the password, as for urlsplit.
    url = re.sub(r"^([^:/?#]+://[^:/?#@]*:)[^/?#]*@", r"\1***@", url)
    return re.sub(r"([?&]password=)[^&#]*", r"\1***", url)


def _parse_redis_url(url: str) -> None:
    """Parse ``url`` as ``RedisBackend`` will, raising ValueError."""
    try:
        from redis.connection import parse_url
    except ImportError:  # pragma: no cover - RedisBackend then says what to install
        return
    parse_url("redis://" + url.split("://", 1)[1] if url.startswith("redis+cluster://") else url)


def _parse_postgres_url(url: str) -> None:
    """Parse ``url`` as libpq will, raising ValueError."""
    try:
        from psycopg import conninfo
    except ImportError:  # the factory then says what to install
        return
    try:
        conninfo.conninfo_to_dict(url)
    except Exception as e:  # psycopg.ProgrammingError, with libpq's words
        raise ValueError(" ".join(str(e).split())) from None


def check_password(what: str, value: Any) -> str:
    """:func:`_text`, with an error that does not show the value."""
    try:
        return _text(what, value)
    except ConfigurationError:
        raise ConfigurationError(f"{what}(not shown) is invalid: expected a non-empty string of UTF-8 text.") from None


def _flag(what: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigurationError(f"{what}{value!r} is invalid: expected True or False.")
    return value


def _policy(what: str, value: Any) -> str:
    if value not in BACKEND_ERROR_POLICIES:
        raise ConfigurationError(f"{what}{value!r} is invalid: expected one of {', '.join(BACKEND_ERROR_POLICIES)}.")
    return str(value)


_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "url": check_backend_url,
    "prefix": _prefix,
    "lock_ttl": _positive_int,
    "lease": _positive_int,
    "reschedule_delay": _non_negative_int,
    "enabled": _flag,
    "on_backend_error": _policy,
    "provisional_window": _non_negative_int,
    "reap_interval": _non_negative_int,
    "record_lock_args": _flag,
    "min_replicas": _replicas,
    "min_replicas_timeout": _positive_int,
    "shutdown_timeout": _positive_int,
    "dashboard_password": check_password,
}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _parse(variable: str, raw: str, field: str) -> Any:
    what = f"Environment variable {variable}="
    check = _CHECKS[field]
    if check in (_positive_int, _non_negative_int, _replicas):
        try:
            number = int(raw.strip())
        except ValueError:
            unit = "replicas" if check is _replicas else "milliseconds"
            raise ConfigurationError(f"{what}{raw!r} is invalid: expected a whole number of {unit}.") from None
        return check(what, number)
    if check is _flag:
        if raw.strip().lower() not in _TRUE | _FALSE:
            raise ConfigurationError(f"{what}{raw!r} is invalid: expected 1/0 or true/false.")
        return raw.strip().lower() in _TRUE
    return check(what, raw.strip())


_VARIABLE_PREFIX = "dramatiq_unique_"


#: Every variable read, lower-case, and the setting it sets.
_VARIABLES = {f"{_VARIABLE_PREFIX}{field.name}": field.name for field in fields(Settings)}
_VARIABLES.update({f"{_VARIABLE_PREFIX}{alias}": name for alias, name in ALIASES.items()})


def from_environment(environ: Optional[Mapping[str, str]] = None) -> Settings:
    """Read every ``dramatiq_unique_*`` variable.

    Raises:
      ConfigurationError: naming the variable, when a value is bad or the name is not a setting (a
        misspelt name would otherwise be ignored).
    """
    environ = os.environ if environ is None else environ
    for name in environ:
        lower = name.lower()
        if lower.startswith(_VARIABLE_PREFIX) and lower not in _VARIABLES and name in (lower, name.upper()):
            raise ConfigurationError(
                f"Environment variable {name} is not a dramatiq-unique setting. "
                f"Valid names: {', '.join(sorted(_VARIABLES))}."
            )
    found: dict[str, Any] = {}
    read_as: dict[str, str] = {}
    for variable, field in _VARIABLES.items():
        for spelling in (variable, variable.upper()):
            raw = environ.get(spelling)
            if raw is not None and raw != "":
                value = _parse(spelling, raw, field)
                if field in found and found[field] != value:
                    raise ConfigurationError(
                        f"Environment variable {spelling}={raw!r} is invalid: expected the same as "
                        f"{read_as[field]}, since it is another name for it; set one of them."
                    )
                found[field], read_as[field] = value, read_as.get(field, spelling)
                break
    return Settings(**found)
