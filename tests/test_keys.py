"""Keys that never collide (issue 38): no two actor names, prefixes,
digests or phases build one lock key, every key parses back to exactly
its parts, the common actor name keeps the key an older release wrote,
and every filter by actor, on Redis and PostgreSQL, matches that actor
alone.
"""

from __future__ import annotations

import json
import uuid

import dramatiq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dramatiq_unique import UniqueMiddleware
from dramatiq_unique.backends.base import glob_pattern
from dramatiq_unique.model import wire
from dramatiq_unique.model.wire import LockKey
from dramatiq_unique.ops.admin import LockAdmin
from tests.test_cli import run

MINUTE = 60_000
DIGEST = "0123456789abcdef" * 2

names = st.text(min_size=1)
digests = st.text(alphabet="0123456789abcdef", min_size=32, max_size=32)
phases = st.sampled_from(wire.PHASES)
#: The names an older release wrote unchanged, and can still read.
plain_names = names.filter(lambda name: not set(name) & set("%{}():") and not name.startswith("@"))

#: Actor names that an older release mixed up (``{}`` written as ``()``)
#: or that a filter's ``SCAN`` glob reads as wildcards.
AWKWARD = ("a{1}", "a(1)", "a%7B1%7D", "a*", "a?", "a[1]", "a\\", "b:c", "@any")


def old_actor_scope(actor: str) -> str:
    """The scope an older release wrote for ``actor``."""
    return actor.replace("{", "(").replace("}", ")")


# Properties of the key builder and parser ------------------------------------


@given(prefix=st.text(), name=names, digest=digests, phase=phases)
def test_a_key_parses_back_to_its_actor_and_under_no_other_prefix(prefix: str, name: str, digest: str, phase: str):
    key = wire.lock_key(prefix=prefix, scope=wire.escape_actor(name), digest=digest, phase=phase)
    parts = wire.parse_lock_key(key, prefix=prefix)
    assert parts == LockKey(prefix, wire.escape_actor(name), digest, phase)
    assert parts.actor == name
    # No other prefix reads it, so no other prefix, name, digest or phase
    # builds it: each would parse back to its own parts.
    for i, char in enumerate(key):
        if char == ":" and i != len(prefix):
            assert wire.parse_lock_key(key, prefix=key[:i]) is None, key[:i]


@given(
    one=st.tuples(st.text(), names, digests, phases),
    other=st.tuples(st.text(), names, digests, phases),
)
def test_different_parts_build_different_keys(one: tuple, other: tuple) -> None:
    def key(prefix: str, name: str, digest: str, phase: str) -> str:
        return wire.lock_key(prefix=prefix, scope=wire.escape_actor(name), digest=digest, phase=phase)

    assert (key(*one) == key(*other)) == (one == other)


@given(one=names, other=names)
def test_different_names_get_different_scopes_and_none_is_any_actor(one: str, other: str) -> None:
    assert (wire.escape_actor(one) == wire.escape_actor(other)) == (one == other)
    assert wire.escape_actor(one) != wire.ANY_ACTOR
    assert wire.scope_actor(wire.escape_actor(one)) == one


@given(name=plain_names)
def test_a_plain_name_keeps_the_key_an_older_release_wrote(name: str) -> None:
    assert wire.escape_actor(name) == old_actor_scope(name) == name
    assert wire.actor_scope(name) == name


def test_the_names_whose_keys_change() -> None:
    assert wire.lock_key(prefix="p", scope=wire.escape_actor("sync_account_balance.v2-x"), digest=DIGEST, phase="run") \
        == f"p:sync_account_balance.v2-x:{{{DIGEST}}}:run"
    escaped = {name: wire.escape_actor(name) for name in ("a{1}", "a(1)", "b:c", "50%", "@any", "@x", "x@y", "a\nb")}
    assert escaped == {
        "a{1}": "a%7B1%7D",
        "a(1)": "a%281%29",
        "b:c": "b%3Ac",
        "50%": "50%25",
        "@any": "%40any",
        "@x": "%40x",
        "x@y": "x@y",
        "a\nb": "a\nb",
    }
    assert wire.actor_scope(wire.ANY_ACTOR) == wire.ANY_ACTOR  # a filter's name of unique_across_actors


@given(prefix=st.text(), name=names, digest=digests, phase=phases)
def test_a_filters_glob_matches_its_actors_keys(prefix: str, name: str, digest: str, phase: str) -> None:
    scope = wire.escape_actor(name)
    key = wire.lock_key(prefix=prefix, scope=scope, digest=digest, phase=phase)
    assert glob_pattern(wire.lock_key_glob(prefix=prefix, scope=scope, phase=phase)).fullmatch(key)
    assert glob_pattern(wire.lock_key_glob(prefix=prefix, digest=digest)).fullmatch(key)


def test_a_key_in_the_old_format_reads_as_old_or_not_at_all() -> None:
    # An older release wrote "a(1)" for both "a{1}" and "a(1)": the key
    # parses, and names no actor.
    old = wire.parse_lock_key(f"p:{old_actor_scope('a{1}')}:{{{DIGEST}}}:queue", prefix="p")
    assert old == LockKey("p", "a(1)", DIGEST, wire.QUEUE)
    assert old.actor is None
    for scope in ("50%", "@x", "a%2", "%41", "%7b"):
        assert wire.scope_actor(scope) is None, scope
    # It wrote "b:c" as it is: that key reads as another prefix's.
    assert wire.parse_lock_key(f"p:b:c:{{{DIGEST}}}:queue", prefix="p") is None
    assert wire.parse_lock_key(f"p:b:c:{{{DIGEST}}}:queue", prefix="p:b") == LockKey("p:b", "c", DIGEST, wire.QUEUE)


# Filters by actor on real backends ---------------------------------------------


@pytest.fixture(params=["redis", "postgres"])
def store(request: pytest.FixtureRequest) -> tuple[object, str]:
    """A backend, emptied, and its URL."""
    return request.getfixturevalue(f"{request.param}_backend"), request.getfixturevalue(f"{request.param}_url")


def listed(url: str, prefix: str, *args: str) -> list[str]:
    """The actors ``dramatiq-unique locks`` lists."""
    result = run("locks", "--url", url, "--prefix", prefix, "--json", *args)
    assert result.returncode == 0, result.stderr
    return sorted(lock["actor"] for lock in json.loads(result.stdout))


def test_every_filter_by_actor_matches_that_actor_alone(stub_broker, store) -> None:
    backend, url = store
    prefix = f"k-{uuid.uuid4().hex[:8]}"
    stub_broker.add_middleware(UniqueMiddleware(backend=backend, prefix=prefix, lock_ttl=MINUTE))
    for name in AWKWARD:
        dramatiq.actor(lambda: None, actor_name=name, broker=stub_broker, lock="until_executed").send()
    admin = LockAdmin(backend, prefix=prefix)
    assert sorted(lock.actor for lock in admin.locks()) == sorted(AWKWARD)
    for name in AWKWARD:
        assert [lock.actor for lock in admin.locks(actor=name)] == ([] if name == wire.ANY_ACTOR else [name]), name
    assert listed(url, prefix, "--actor", "a(1)") == ["a(1)"]
    assert listed(url, prefix, "--actor", "a*") == ["a*"]
    assert listed(url, prefix, "--actor", "a?") == ["a?"]

    released = run("release", "--actor", "a(1)", "--yes", "--url", url, "--prefix", prefix)
    assert released.returncode == 0, released.stderr
    assert "Released 1 lock of actor 'a(1)'." in released.stdout
    released = run("release", "--actor", "a*", "--yes", "--url", url, "--prefix", prefix)
    assert "Released 1 lock of actor 'a*'." in released.stdout
    assert listed(url, prefix) == sorted(set(AWKWARD) - {"a(1)", "a*"})


def test_a_colon_in_a_name_or_a_prefix_keeps_the_prefixes_apart(store) -> None:
    backend, url = store
    prefix = f"k-{uuid.uuid4().hex[:8]}"
    for prefix_of, name in ((prefix, "b:c"), (f"{prefix}:b", "c")):
        key = wire.lock_key(prefix=prefix_of, scope=wire.escape_actor(name), digest=DIGEST, phase=wire.QUEUE)
        assert backend.acquire(key, "m", ttl=MINUTE).acquired
    assert listed(url, prefix) == ["b:c"]
    assert listed(url, f"{prefix}:b") == ["c"]
    assert [lock.actor for lock in LockAdmin(backend, prefix=prefix).locks(actor="b:c")] == ["b:c"]
    assert list(LockAdmin(backend, prefix=prefix).locks(actor="c")) == []


def test_a_lock_an_older_release_wrote_is_listed_as_it_wrote_it_and_no_filter_takes_it(store) -> None:
    backend, url = store
    prefix = f"k-{uuid.uuid4().hex[:8]}"
    old = f"{prefix}:a(1):{{{DIGEST}}}:queue"  # "a{1}"'s, or "a(1)"'s
    old_colon = f"{prefix}:b:c:{{{DIGEST}}}:queue"  # "b:c"'s: another prefix's key to this release
    for key in (old, old_colon):
        assert backend.acquire(key, "m", ttl=MINUTE).acquired
    assert listed(url, prefix) == ["a(1)"]
    for name in ("a(1)", "a{1}", "b:c"):
        assert listed(url, prefix, "--actor", name) == [], name
    assert [lock.key for lock in LockAdmin(backend, prefix=prefix).inspect(DIGEST)] == [old]
    released = run("release", DIGEST, "--url", url, "--prefix", prefix, "--json")
    assert json.loads(released.stdout) == {"released": [old]}
