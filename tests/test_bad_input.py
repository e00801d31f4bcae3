"""Bad input, property-based: every refused input gets a clear error
where it is given, and leaves no lock and no message behind.

* Lock args are refused at ``send()`` with a ``ConfigurationError``
  that names the actor.
* Actor options are refused at declaration, and the actor is not
  registered.
* Environment variables and constructor arguments are refused when the
  middleware is constructed, naming the variable or argument and the
  form it expects.

Each refusal is checked on a StubBroker with a StubBackend and on a
RedisBroker with a RedisBackend.  The expected outcome of a random
input comes from an oracle written from the README, not from the code.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import uuid
from dataclasses import fields
from typing import Any, Callable, Iterator, Optional
from unittest import mock
from urllib.parse import urlsplit

import dramatiq
import pytest
import redis
from dramatiq import Actor
from dramatiq.brokers.redis import RedisBroker
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import MiddlewareError
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dramatiq_unique import (
    LOCK_TYPES,
    STRATEGIES,
    ConfigurationError,
    LockBackend,
    LockInfo,
    StubBackend,
    UniqueMiddleware,
)
from dramatiq_unique.backends.redis import RedisBackend
from dramatiq_unique.settings import MAX_DURATION, MAX_REPLICAS, Settings
from tests.conftest import make_worker

#: Many cheap examples: each one is a call or two in this process.
MANY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

#: Fewer examples for those that touch Redis several times.
SOME = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

PARAMETERS = ("account_id", "requested_at")


def sync(account_id: Any, requested_at: Any = None) -> None:
    """The actor body every test declares: a balance sync."""


def key_of(account_id: Any, requested_at: Any = None) -> Any:
    """A ``lock_args_method``: the key is the account alone."""
    return {"account": account_id}


# Rigs ---------------------------------------------------------------------------


class Rig:
    """A broker and a ``UniqueMiddleware`` whose lock keys, queues and
    actor names belong to this rig alone, so that one rig can serve
    every example of a test.

    Parameters:
      kind(str): ``"stub"`` (StubBroker + StubBackend) or ``"redis"``
        (RedisBroker + RedisBackend).
      redis_url(str): The suite's Redis.
    """

    queue = "props"

    def __init__(self, kind: str, redis_url: str) -> None:
        self.prefix = f"props-{uuid.uuid4().hex[:8]}"
        self.namespace = f"{self.prefix}-broker"  # never matches "{prefix}:*"
        self.broker: dramatiq.Broker
        backend: LockBackend
        if kind == "stub":
            self.broker = StubBroker()
            self.broker.emit_after("process_boot")
            backend = StubBackend()
        else:
            self.broker = RedisBroker(url=redis_url, namespace=self.namespace)
            backend = RedisBackend(url=redis_url)
        self.unique = UniqueMiddleware(backend=backend, prefix=self.prefix, reschedule_delay=100)
        self.broker.add_middleware(self.unique)
        self.worker: Optional[dramatiq.Worker] = None
        self._numbers = itertools.count()

    def declare(self, fn: Callable[..., Any] = sync, *, name: Optional[str] = None, **options: Any) -> Actor[Any, Any]:
        """Declare ``fn`` on this rig's queue as ``name``, or under a
        fresh actor name.
        """
        return dramatiq.actor(  # type: ignore[call-overload,no-any-return]
            fn, broker=self.broker, actor_name=name or self.next_name(fn), queue_name=self.queue, **options
        )

    def next_name(self, fn: Callable[..., Any] = sync) -> str:
        """The name :meth:`declare` gives its next actor."""
        number = next(self._numbers)
        return f"{fn.__name__}_{number}"

    def queued(self) -> int:
        """Messages waiting in every queue and delay queue."""
        names = [*self.broker.get_declared_queues(), *self.broker.get_declared_delay_queues()]
        if isinstance(self.broker, StubBroker):
            return sum(self.broker.queues[name].qsize() for name in names)
        client = self.broker.client  # type: ignore[attr-defined]
        return sum(int(client.llen(f"{self.namespace}:{name}")) for name in names)

    def inspect(self, key: str) -> Optional[LockInfo]:
        return self.unique.backend.inspect(key)  # type: ignore[union-attr]

    def locks(self) -> list[str]:
        """Every lock key of this rig, as the backend lists them."""
        return sorted(self.unique.backend.scan(f"{self.prefix}:*"))  # type: ignore[union-attr]

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Run an in-process worker for the duration of the block.

        Started inside the test body, never across examples: a live
        RedisBroker consumer draws from ``random``, and hypothesis
        flags that while it generates the next example.
        """
        self.worker = make_worker(self.broker, threads=4)
        try:
            yield
        finally:
            self.worker.stop()
            self.worker = None

    def drain(self) -> None:
        """Wait until every message of the queue was processed."""
        if isinstance(self.broker, StubBroker):
            self.broker.join(self.queue, fail_fast=False)
        else:
            self.broker.join(self.queue, interval=10, timeout=30_000)  # type: ignore[call-arg]
        assert self.worker is not None
        self.worker.join()

    def reset(self) -> None:
        """Drop every message and lock, between examples."""
        self.broker.flush_all()
        for key in self.locks():
            self.unique.backend.delete(key)  # type: ignore[union-attr]

    def close(self) -> None:
        self.reset()
        if isinstance(self.broker, RedisBroker):
            for key in self.broker.client.scan_iter(match=f"{self.prefix}*"):
                self.broker.client.delete(key)
        self.broker.close()


def rigs(kind: str, redis_url: str) -> Iterator[Rig]:
    """A rig for one test module."""
    rig = Rig(kind, redis_url)
    try:
        yield rig
    finally:
        rig.close()


@pytest.fixture(scope="module", params=["stub", "redis"])
def idle_rig(request: pytest.FixtureRequest, redis_url: str) -> Iterator[Rig]:
    """A rig with no worker: what is sent stays in its queue."""
    yield from rigs(request.param, redis_url)


# Lock args ------------------------------------------------------------------


json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)

#: Key material that JSON carries exactly (tuples arrive as lists).
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


class Exploding(list):
    """A list whose iteration fails, as a custom container might."""

    def __iter__(self) -> Iterator[Any]:
        raise RuntimeError("this container cannot be iterated")


def nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


class Unbuilt:
    """Stands for a value that :func:`built` makes in the test body:
    hypothesis cannot print a cyclic or very deep one when it reports.
    """

    def __init__(self, description: str, make: Callable[[], Any]) -> None:
        self.description, self.make = description, make

    def __repr__(self) -> str:
        return f"<{self.description}>"


def built(value: Any) -> Any:
    """``value`` with every :class:`Unbuilt` made."""
    if isinstance(value, Unbuilt):
        return value.make()
    if isinstance(value, dict):
        return {key: built(item) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(built(item) for item in value)
    return value


def circular() -> list[Any]:
    value: list[Any] = []
    value.append(value)
    return value


#: One value JSON cannot carry exactly.
bad_leaves = st.one_of(
    st.builds(object),
    st.sets(st.integers(), max_size=3),
    st.frozensets(st.text(max_size=3), max_size=3),
    st.binary(max_size=8),
    st.binary(max_size=8).map(bytearray),
    st.sampled_from([math.nan, math.inf, -math.inf]),
    st.complex_numbers(allow_nan=False, allow_infinity=False),
    st.decimals(allow_nan=False, allow_infinity=False),
    st.datetimes(),
    st.builds(
        lambda bad, good: {**good, **bad},
        st.dictionaries(
            st.integers() | st.none() | st.booleans() | st.floats(allow_nan=False) | st.tuples(st.integers()),
            json_values,
            min_size=1,
            max_size=3,
        ),
        st.dictionaries(st.text(max_size=5), json_values, max_size=2),
    ),
    st.builds(
        lambda before, surrogate, after: before + surrogate + after,
        st.text(max_size=5),
        st.characters(categories=["Cs"]),
        st.text(max_size=5),
    ),
    st.integers(min_value=4_301, max_value=6_000).map(lambda digits: 10**digits),
    # Far deeper than any recursion limit: hypothesis raises the limit
    # while it runs a test, so a value just past the usual 1000 passes.
    st.integers(min_value=50_000, max_value=200_000).map(
        lambda depth: Unbuilt(f"a list nested {depth} deep", lambda: nested(depth))
    ),
    st.just(Unbuilt("a list that contains itself", circular)),
    st.lists(st.integers(), max_size=2).map(Exploding),
)


def _embed(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Put a bad value somewhere inside otherwise valid material."""
    return st.one_of(
        st.tuples(st.lists(json_values, max_size=3), inner, st.integers(0, 3)).map(
            lambda t: [*t[0][: t[2]], t[1], *t[0][t[2] :]]
        ),
        st.tuples(st.dictionaries(st.text(max_size=5), json_values, max_size=3), st.text(max_size=5), inner).map(
            lambda t: {**t[0], t[1]: t[2]}
        ),
        inner.map(lambda value: (value,)),
    )


#: Material with at least one value JSON cannot carry exactly.
bad_values = st.recursive(bad_leaves, _embed, max_leaves=3)

#: Calls that do not fit ``sync(account_id, requested_at=None)``.
bad_calls = st.one_of(
    st.lists(json_values, min_size=3, max_size=4).map(lambda args: (tuple(args), {})),
    st.just(((), {})),
    st.tuples(json_values, st.text(min_size=1, max_size=8).filter(lambda n: n not in PARAMETERS), json_values).map(
        lambda t: ((t[0],), {t[1]: t[2]})
    ),
    json_values.map(lambda value: ((value,), {"account_id": value})),
)

#: The actors lock args are sent to: one per lock type, by name, by method.
ARG_ACTORS = (*LOCK_TYPES, "lock_args", "lock_args_method")


@pytest.fixture(scope="module")
def arg_actors(idle_rig: Rig) -> dict[str, Actor[Any, Any]]:
    actors = {lock: idle_rig.declare(lock=lock) for lock in LOCK_TYPES}
    actors["lock_args"] = idle_rig.declare(lock="until_executed", lock_args=["account_id"])
    actors["lock_args_method"] = idle_rig.declare(lock="while_executing", lock_args_method=key_of)
    return actors


def send(actor: Actor[Any, Any], how: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Enqueue one message by one of the ways Dramatiq offers."""
    if how == "send":
        return actor.send(*args, **kwargs)
    if how == "delayed":
        return actor.send_with_options(args=args, kwargs=kwargs, delay=60_000)
    return actor.broker.enqueue(actor.message(*args, **kwargs))


HOW = st.sampled_from(["send", "delayed", "enqueue"])


@MANY
@given(value=bad_values, actor=st.sampled_from(ARG_ACTORS), by_name=st.booleans(), how=HOW)
def test_unsendable_lock_args_are_refused_at_send(
    idle_rig: Rig, arg_actors: dict[str, Actor[Any, Any]], value: Any, actor: str, by_name: bool, how: str
) -> None:
    # Given a value JSON cannot carry exactly, passed as the key's argument
    target, value = arg_actors[actor], built(value)
    args, kwargs = ((), {"account_id": value, "requested_at": 1.5}) if by_name else ((value, 1.5), {})
    # When it is sent
    with pytest.raises(ConfigurationError) as info:
        send(target, how, args, kwargs)
    # Then the error names the actor, and nothing was locked or enqueued
    assert target.actor_name in str(info.value)
    assert idle_rig.queued() == 0
    assert idle_rig.locks() == []


@MANY
@given(call=bad_calls, actor=st.sampled_from(ARG_ACTORS), how=HOW)
def test_arguments_that_do_not_fit_the_actor_are_refused_at_send(
    idle_rig: Rig,
    arg_actors: dict[str, Actor[Any, Any]],
    call: tuple[tuple[Any, ...], dict[str, Any]],
    actor: str,
    how: str,
) -> None:
    target = arg_actors[actor]
    with pytest.raises(ConfigurationError) as info:
        send(target, how, *call)
    assert target.actor_name in str(info.value)
    assert idle_rig.queued() == 0
    assert idle_rig.locks() == []


def test_a_lone_surrogate_is_refused_not_sent_unlocked(idle_rig: Rig, arg_actors: dict[str, Actor[Any, Any]]) -> None:
    # Before the fix, UnicodeEncodeError escaped the hook, Dramatiq
    # logged and swallowed it, and the message went out with no lock.
    actor = arg_actors["until_executed"]
    for _ in range(2):
        with pytest.raises(ConfigurationError, match="surrogates not allowed"):
            actor.send("caf\udce9")
    assert idle_rig.queued() == 0 and idle_rig.locks() == []


def test_dict_keys_json_would_rename_are_refused(idle_rig: Rig, arg_actors: dict[str, Actor[Any, Any]]) -> None:
    # JSON turns 1, True and None into "1", "true" and "null": such keys
    # would share a lock with the str keys they become.
    actor = arg_actors["until_executed"]
    for key in (1, True, None, 2.5):
        with pytest.raises(ConfigurationError, match="is not a str"):
            actor.send({key: "x"})
    try:
        assert "unique_duplicate_of" not in actor.send({"1": "x"}).options
        assert idle_rig.queued() == 1
    finally:
        idle_rig.reset()


# Actor options ----------------------------------------------------------------

_durations = (
    st.integers(-3, 3)
    | st.integers(MAX_DURATION - 2, MAX_DURATION + 2)
    | st.integers(min_value=10**18, max_value=10**30)
    | st.floats(allow_nan=True)
    | st.booleans()
    | st.sampled_from(["1000", "", "1s"])
)
_strategy_names = st.sampled_from([*STRATEGIES["client"], *STRATEGIES["server"], "replace", "", "Log"])
_flags = st.booleans() | st.integers(0, 1) | st.sampled_from(["yes", "False"])

#: Every actor option, valid or not, each maybe absent.  Values that
#: should fail mix with valid ones so that most draws have a lock and
#: some declare cleanly.
actor_options = st.fixed_dictionaries(
    {"lock": st.sampled_from(list(LOCK_TYPES)) | st.sampled_from([None, "", "While_Executing", "until_executin", 3])},
    optional={
        "on_conflict": st.none()
        | _strategy_names
        | st.dictionaries(st.sampled_from(["client", "server", "worker"]), _strategy_names, max_size=2)
        | st.lists(_strategy_names, max_size=2)
        | st.integers(),
        "lock_args": st.none()
        | st.lists(st.sampled_from([*PARAMETERS, "acount_id"]), max_size=3)
        | st.lists(st.sampled_from(PARAMETERS), max_size=2).map(tuple)
        | st.sampled_from(["account_id", ""])
        | st.lists(st.integers(), min_size=1, max_size=2),
        "lock_args_method": st.none() | st.just(key_of) | st.integers() | st.just("key_of"),
        "lock_ttl": st.none() | _durations,
        "lock_limit": st.none() | st.integers(-2, 4) | st.floats(0, 4) | st.booleans() | st.just("2"),
        "unique_across_queues": st.none() | _flags,
        "unique_across_actors": st.none() | _flags,
        "reschedule_delay": st.none() | _durations,
    },
)


def resolve_on_conflict(lock: str, on_conflict: Any) -> Optional[dict[str, str]]:
    """The strategy per side of ``lock`` (README "Actor options"), or
    None when ``on_conflict`` is not valid for it.
    """
    row = LOCK_TYPES[lock]
    chosen = {side: STRATEGIES[side][0] for side in row.sides}
    if on_conflict is None:
        return chosen
    if on_conflict == "replace" and row.queue_lock:
        given = {"client": "replace"}  # the one client-only name: the server side keeps its default
    elif isinstance(on_conflict, str):
        given = {side: on_conflict for side in row.sides}
    elif isinstance(on_conflict, dict):
        given = on_conflict
    else:
        return None
    for side, name in given.items():
        if side not in row.sides or name not in STRATEGIES[side]:
            return None
        chosen[side] = name
    return chosen


def is_whole(value: Any, low: int, high: Optional[int] = None) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value and (high is None or value <= high)


def option_faults(options: dict[str, Any]) -> set[str]:
    """The options the README says are wrong; empty when all are fine."""
    given = {name: value for name, value in options.items() if value is not None}
    lock = given.pop("lock", None)
    if lock is None:
        return set(given)
    if not isinstance(lock, str) or lock not in LOCK_TYPES:
        return {"lock"}
    sides = resolve_on_conflict(lock, given.get("on_conflict"))
    checks: dict[str, Callable[[Any], bool]] = {
        "on_conflict": lambda _: sides is not None,
        "lock_args": lambda v: (
            isinstance(v, (list, tuple)) and all(isinstance(n, str) and n in PARAMETERS for n in v)
        ),
        "lock_args_method": callable,
        "lock_ttl": lambda v: is_whole(v, 1, MAX_DURATION) and LOCK_TYPES[lock].queue_lock,
        "lock_limit": lambda v: is_whole(v, 1) and (v == 1 or sides is None or sides.get("client") != "replace"),
        "unique_across_queues": lambda v: isinstance(v, bool),
        "unique_across_actors": lambda v: isinstance(v, bool),
        "reschedule_delay": lambda v: (
            is_whole(v, 0, MAX_DURATION) and (sides is None or sides.get("server") == "reschedule")
        ),
    }
    faults = {name for name, value in given.items() if not checks[name](value)}
    if "lock_args" in given and "lock_args_method" in given:
        faults |= {"lock_args", "lock_args_method"}
    return faults


@MANY
@given(options=actor_options)
def test_actor_options_are_checked_at_declaration(idle_rig: Rig, options: dict[str, Any]) -> None:
    faults = option_faults(options)
    event(f"refused for {len(faults)} option(s)" if faults else "declared")
    name = idle_rig.next_name()
    if faults:
        # Then a bad combination fails at declaration, naming an option at fault
        with pytest.raises(ConfigurationError) as info:
            idle_rig.declare(name=name, **options)
        message = str(info.value)
        assert any(("lock=" if fault == "lock" else fault) in message for fault in faults), (faults, message)
        assert isinstance(info.value, ValueError) and isinstance(info.value, MiddlewareError)
        assert name not in idle_rig.broker.actors and name not in idle_rig.unique.specs
    else:
        # And a good one declares, resolved as the README says
        idle_rig.declare(name=name, **options)
        assert name in idle_rig.broker.actors
        spec = idle_rig.unique.specs.get(name)
        if options.get("lock") is None:
            assert spec is None
        else:
            assert spec is not None
            sides = resolve_on_conflict(options["lock"], options.get("on_conflict"))
            assert sides is not None
            resolved = (spec.lock.name, spec.client, spec.server)
            assert resolved == (options["lock"], sides.get("client"), sides.get("server"))
            assert spec.lock_limit == (options.get("lock_limit") or 1)
    assert idle_rig.queued() == 0 and idle_rig.locks() == []


@pytest.mark.parametrize("typo", ["lok", "lock_arg", "on_conflicts", "unique_across_queue", "lock_tll"])
def test_a_misspelt_option_is_refused_by_dramatiq(idle_rig: Rig, typo: str) -> None:
    name = idle_rig.next_name()
    with pytest.raises(ValueError, match=typo):
        idle_rig.declare(name=name, **{"lock": "until_executed", typo: 1})
    assert name not in idle_rig.broker.actors


# Environment variables ----------------------------------------------------------

#: Every variable, in both spellings.
#: Settings read under a second name too: alias -> setting.
ALIASES = {"redis_url": "url"}
NAMES = [*(f.name for f in fields(Settings)), *ALIASES]
SPELLINGS = [n for name in NAMES for n in (f"dramatiq_unique_{name}", f"DRAMATIQ_UNIQUE_{name.upper()}")]
TRUE, FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}
POLICIES = ("fail", "run_unlocked")
REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://")
POSTGRES_SCHEMES = ("postgresql://", "postgres://")
SCHEMES = REDIS_SCHEMES + POSTGRES_SCHEMES

#: Strings that sit on either side of each variable's rules.
NEAR_MISSES = [
    "0", "1", "-1", "+5", " 42 ", "1_000", "1.5", "1e3", "60s", "0x10", str(MAX_DURATION), str(MAX_DURATION + 1),
    "true", "FALSE", " Yes ", "on", "maybe", "fail", "run_unlocked", "Fail", "ignore",
    "redis://127.0.0.1:6379/6", "rediss://h:1/2?socket_timeout=3", "unix:///tmp/redis.sock", "redis+cluster://h:7000",
    "redis://h:abc/0", "redis://h:99999", "redis://[::1", "redis://h/0?socket_timeout=x", "http://h:6379", "REDIS://h",
    "postgresql://u@h:5432/db", "postgres:///db", "postgresql://h:99999/db", "postgresql://[::1", "POSTGRES://h",
    "app", "a{b}", "}", "  ", "caf\udce9",
]

env_values = st.one_of(
    st.text(max_size=30),
    st.sampled_from(NEAR_MISSES),
    st.integers().map(str),
    st.text(alphabet=" 0123456789+-_.", max_size=8),
    st.builds(lambda scheme, rest: scheme + rest, st.sampled_from(SCHEMES), st.text(max_size=15)),
)


def utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def url_accepts(url: str) -> bool:
    """Whether ``from_url(url)`` can parse ``url`` (it connects later):
    a Redis URL that redis-py parses, a PostgreSQL one that libpq does
    (when psycopg is installed; otherwise its port only).
    """
    if not url.startswith(SCHEMES):
        return False
    try:
        _ = urlsplit(url).port  # raises ValueError on a bad port
        if url.startswith(REDIS_SCHEMES):
            redis.Redis.from_url("redis://" + url.split("://", 1)[1] if url.startswith("redis+cluster://") else url)
    except ValueError:
        return False
    if url.startswith(POSTGRES_SCHEMES):
        try:
            from psycopg import conninfo
        except ImportError:
            return True
        try:
            conninfo.conninfo_to_dict(url)
        except Exception:
            return False
    return True


def read_setting(name: str, value: Any, *, text: bool) -> tuple[bool, Any]:
    """Whether ``value`` is good for setting ``name``, and what it
    reads as.  ``text`` is True for an environment variable.
    """
    if name == "min_replicas":
        if text:
            try:
                value = int(value)
            except ValueError:
                return False, None
        return is_whole(value, 0, MAX_REPLICAS), value
    durations = ("lock_ttl", "lease", "reschedule_delay", "provisional_window", "reap_interval", "min_replicas_timeout",
                 "shutdown_timeout")
    if name in durations:
        low = 0 if name in ("reschedule_delay", "provisional_window", "reap_interval") else 1
        if text:
            try:
                value = int(value)
            except ValueError:
                return False, None
        return is_whole(value, low, MAX_DURATION), value
    if name in ("enabled", "record_lock_args"):
        if not text:
            return isinstance(value, bool), value
        word = value.strip().lower()
        return word in TRUE | FALSE, word in TRUE
    if text:
        value = value.strip()
    if name == "on_backend_error":
        return isinstance(value, str) and value in POLICIES, value
    if not isinstance(value, str) or not value.strip() or not utf8(value):
        return False, None
    if name == "prefix":
        return "{" not in value and "}" not in value, value
    if name == "dashboard_password":
        return True, value  # any text: the README asks for no form
    return url_accepts(value), value


def expected_settings(environ: dict[str, str]) -> tuple[Optional[Settings], set[str]]:
    """The settings an environment gives, or None and the variables at
    fault.  An empty value counts as unset; lower case wins.
    """
    found: dict[str, Any] = {}
    faults = set()
    for name in NAMES:
        lower, upper = f"dramatiq_unique_{name}", f"DRAMATIQ_UNIQUE_{name.upper()}"
        spelling = lower if environ.get(lower) else upper if environ.get(upper) else None
        if spelling is None:
            continue
        field = ALIASES.get(name, name)
        good, value = read_setting(field, environ[spelling], text=True)
        if good and found.get(field, value) == value:  # an alias must agree with its setting
            found[field] = value
        else:
            faults.add(spelling)
    return (None, faults) if faults else (Settings(**found), faults)


def only(environ: dict[str, str]) -> Any:
    """Patch ``os.environ`` to hold ``environ`` and no other
    ``dramatiq_unique_*`` variable.
    """
    patch = mock.patch.dict(os.environ)
    patch.start()
    for name in [name for name in os.environ if name.lower().startswith("dramatiq_unique_")]:
        del os.environ[name]
    os.environ.update(environ)
    return patch


@MANY
@given(environ=st.dictionaries(st.sampled_from(SPELLINGS), env_values, max_size=6))
def test_every_environment_variable_is_read_or_refused_by_name(environ: dict[str, str]) -> None:
    from dramatiq_unique.settings import from_environment

    expected, faults = expected_settings(environ)
    event("refused" if faults else "read")
    if expected is not None:
        assert from_environment(environ) == expected
        return
    with pytest.raises(ConfigurationError) as info:
        from_environment(environ)
    message = str(info.value)
    assert any(f"Environment variable {spelling}=" in message for spelling in faults), (faults, message)
    assert "expected" in message


def constructible(value: str) -> bool:
    """Not a Cluster URL: ``RedisCluster`` connects when it is built,
    and this machine has no Cluster at that address.
    """
    return not value.strip().startswith("redis+cluster://")


#: What a process environment can hold: no NUL, and surrogates only as
#: the escapes of undecodable bytes.
process_env_values = env_values.filter(
    lambda value: constructible(value)
    and "\x00" not in value
    and all(not 0xD800 <= ord(c) <= 0xDFFF or 0xDC80 <= ord(c) <= 0xDCFF for c in value)
)


@SOME
@given(environ=st.dictionaries(st.sampled_from(SPELLINGS), process_env_values, max_size=4))
def test_the_middleware_reads_the_process_environment_or_refuses_it_at_construction(environ: dict[str, str]) -> None:
    expected, faults = expected_settings(environ)
    event("refused" if faults else "read")
    patch = only(environ)
    try:
        if expected is not None:
            assert UniqueMiddleware().settings == expected
            return
        with pytest.raises(ConfigurationError) as info:
            UniqueMiddleware()
        assert any(spelling in str(info.value) for spelling in faults)
    finally:
        patch.stop()


# Constructor arguments -----------------------------------------------------------

_texts = st.one_of(
    st.none(),
    st.text(max_size=12),
    st.sampled_from(["app", "a{b}", " ", "p\udcff"]),
    st.integers(),
    st.binary(max_size=3),
)

constructor_arguments = st.fixed_dictionaries(
    {},
    optional={
        "backend": st.none() | st.builds(StubBackend) | st.just("redis://127.0.0.1:6379/6") | st.builds(object),
        "url": st.none() | st.sampled_from(NEAR_MISSES).filter(constructible) | st.text(max_size=10) | st.integers(),
        "redis_url": (
            st.none() | st.sampled_from(NEAR_MISSES).filter(constructible) | st.text(max_size=10) | st.integers()
        ),
        "prefix": _texts,
        "lock_ttl": st.none() | _durations,
        "lease": st.none() | _durations,
        "reschedule_delay": st.none() | _durations,
        "enabled": st.none() | _flags,
        "on_backend_error": st.none() | st.sampled_from([*POLICIES, "Fail", " fail", "ignore"]) | st.integers(),
        "provisional_window": st.none() | _durations,
        "reap_interval": st.none() | _durations,
        "record_lock_args": st.booleans() | _flags | st.none(),
        "min_replicas": st.none() | st.integers(-2, 3) | st.sampled_from(["1", "x", "-1", "1001"]),
        "min_replicas_timeout": st.none() | _durations,
    },
)


def argument_faults(arguments: dict[str, Any]) -> set[str]:
    faults = set()
    for name, value in arguments.items():
        if name == "backend":
            good = value is None or isinstance(value, LockBackend)
        else:
            good = value is None or read_setting(name, value, text=False)[0]
        if not good:
            faults.add(name)
    url, alias = arguments.get("url"), arguments.get("redis_url")
    if url is not None and alias is not None and url != alias:
        faults.add("redis_url")  # another name for url, which must agree
    return faults


@MANY
@given(arguments=constructor_arguments)
def test_constructor_arguments_are_checked_at_construction(arguments: dict[str, Any]) -> None:
    faults = argument_faults(arguments)
    event("refused" if faults else "constructed")
    patch = only({})
    try:
        if not faults:
            middleware = UniqueMiddleware(**arguments)
            for name, value in arguments.items():
                if value is not None and name != "backend":
                    assert getattr(middleware.settings, name) == value
            return
        with pytest.raises(ConfigurationError) as info:
            UniqueMiddleware(**arguments)
        message = str(info.value)
        assert any(f"{name}=" in message for name in faults) and "expected" in message, (faults, message)
    finally:
        patch.stop()


def test_a_backend_that_is_not_one_is_refused_before_it_can_send_unlocked() -> None:
    # Before the fix the string was kept, the send's AttributeError was
    # swallowed by Dramatiq, and duplicates went out unlocked.
    url = "redis://127.0.0.1:6379/6"
    with pytest.raises(ConfigurationError, match=f"backend='{url}' is invalid: expected a LockBackend"):
        UniqueMiddleware(backend=url)  # type: ignore[arg-type]
