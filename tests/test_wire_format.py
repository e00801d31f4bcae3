"""The wire format (:mod:`dramatiq_unique.model.wire`): what one process
writes and another reads.  Keys, owners, places and records round-trip
through their builders and parsers, awkward inputs included; the Lua
scripts write the records that the Python decoder reads; and no module
of the package spells a ``unique_*`` option name of its own.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Optional

import redis
from hypothesis import given
from hypothesis import strategies as st

import dramatiq_unique
from dramatiq_unique.backends.records import Copy
from dramatiq_unique.backends.redis import RedisBackend
from dramatiq_unique.model import wire
from dramatiq_unique.model.wire import EnqueueRecord, LockKey, Owner, Place
from dramatiq_unique.ops.admin import LockAdmin

DAY = 86_400_000
DIGEST = "0123456789abcdef" * 2

digests = st.text(alphabet="0123456789abcdef", min_size=32, max_size=32)
# Any actor name, as the key shows it: braces, colons, glob characters,
# newlines and unicode included.
scopes = st.text(min_size=1).map(wire.escape_actor)


# Keys ---------------------------------------------------------------------


@given(prefix=st.text(), scope=scopes, digest=digests, phase=st.sampled_from(wire.PHASES))
def test_a_lock_key_parses_back_into_its_parts(prefix: str, scope: str, digest: str, phase: str) -> None:
    key = wire.lock_key(prefix=prefix, scope=scope, digest=digest, phase=phase)
    assert wire.parse_lock_key(key, prefix=prefix) == LockKey(prefix, scope, digest, phase)
    assert wire.digest_in(key) == digest


def test_awkward_keys_parse_back() -> None:
    for prefix, actor in [
        ("", "job"),  # an empty prefix
        ("a:b", "job"),  # colons in the prefix
        ("p", "ns:job"),  # and in the actor
        ("p", f"x:{{{DIGEST}}}:run"),  # an actor that looks like a whole key
        ("préfixe", "tâche_日本"),  # unicode
        ("p", "{braces}"),  # braces, escaped
        ("p", "a\nb"),  # a newline
        ("p", wire.ANY_ACTOR),
    ]:
        scope = wire.actor_scope(actor)
        for phase in wire.PHASES:
            key = wire.lock_key(prefix=prefix, scope=scope, digest=DIGEST, phase=phase)
            assert wire.parse_lock_key(key, prefix=prefix) == LockKey(prefix, scope, DIGEST, phase), key
            assert wire.parse_lock_key(key, prefix=prefix).actor == actor
    assert wire.actor_scope("{braces}") == "%7Bbraces%7D"


def test_what_is_not_a_lock_key_does_not_parse() -> None:
    key = wire.lock_key(prefix="p", scope="job", digest=DIGEST, phase=wire.RUN)
    assert wire.parse_lock_key(key, prefix="q") is None  # another prefix
    assert wire.parse_lock_key(key, prefix="p:job") is None  # a prefix that only starts it
    companions = (wire.waiters_key(key), wire.bodies_key(key), wire.message_key(key, "m"), wire.superseded_key(key))
    for companion in companions:
        assert wire.parse_lock_key(companion, prefix="p") is None
    assert wire.parse_lock_key(wire.lock_key(prefix="p", scope="", digest=DIGEST, phase=wire.RUN), prefix="p") is None
    assert wire.parse_lock_key(wire.lock_key(prefix="p", scope="j", digest="ABC", phase=wire.RUN), prefix="p") is None
    assert wire.parse_lock_key(wire.lock_key(prefix="p", scope="j", digest=DIGEST, phase="x"), prefix="p") is None
    assert wire.parse_lock_key(wire.check_key("p"), prefix="p") is None
    assert wire.parse_lock_key(wire.reaper_key("p"), prefix="p") is None


def test_a_digest_is_found_in_a_digest_or_a_key() -> None:
    assert wire.digest_in(f"  {DIGEST}\n") == DIGEST
    assert wire.digest_in(f"any:prefix:job:{{{DIGEST}}}:queue") == DIGEST
    assert wire.digest_in("job") is None
    assert wire.digest_in(DIGEST[:-1]) is None


def test_the_companion_keys_share_the_lock_keys_hash_tag() -> None:
    key = wire.lock_key(prefix="p", scope="job", digest=DIGEST, phase=wire.RUN)
    assert wire.waiters_key(key) == f"p:job:{{{DIGEST}}}:run:wait"
    assert wire.bodies_key(key) == f"p:job:{{{DIGEST}}}:run:bodies"
    assert wire.message_key(key, "m/1") == f"p:job:{{{DIGEST}}}:run:m:m/1"
    assert wire.superseded_key(key) == f"p:job:{{{DIGEST}}}:run:superseded"


def test_a_key_glob_matches_special_characters_as_any_one() -> None:
    assert wire.lock_key_glob(prefix="p*[x]") == "p??x?:*:*"
    assert wire.lock_key_glob(prefix="p", scope="a?b", phase=wire.QUEUE) == "p:a?b:*:queue"
    assert wire.lock_key_glob(prefix="p", digest=DIGEST) == f"p:*:{{{DIGEST}}}:*"


# Owners -------------------------------------------------------------------

message_ids = st.text().filter(lambda text: wire.OWNER_SEPARATOR not in text)


@given(message_id=message_ids, token=st.none() | st.text())
def test_an_owner_splits_back_into_its_message_and_token(message_id: str, token: Optional[str]) -> None:
    owner = wire.join_owner(message_id, token)
    assert wire.split_owner(owner) == Owner(message_id, token)
    assert wire.message_id_of(owner) == (message_id if owner else None)


def test_awkward_owners_split_back() -> None:
    for message_id, token in [("m", ""), ("", "t"), ("m:é", "t/with/slashes"), ("", None), ("日本", "1.ff.2")]:
        assert wire.split_owner(wire.join_owner(message_id, token)) == Owner(message_id, token)
    # The Lua scripts read a message id up to the first "/": so does Python.
    assert wire.split_owner("a/b/c") == Owner("a", "b/c")
    assert wire.message_id_of(None) is None and wire.message_id_of("") is None


# Records and places ---------------------------------------------------------

lines = st.text().filter(lambda text: "\n" not in text)
fields = st.text().filter(lambda text: "\t" not in text and "\n" not in text)


@given(
    taken_at=st.integers(min_value=0, max_value=2**53),
    provisional_until=st.integers(min_value=0, max_value=2**53),
    where=lines,
    before=st.text(),
)
def test_a_record_decodes_back(taken_at: int, provisional_until: int, where: str, before: str) -> None:
    record = EnqueueRecord(taken_at, provisional_until, where, before)
    assert EnqueueRecord.decode(record.encode()) == record


@given(namespace=fields.filter(bool), queue=fields, redis_id=fields.filter(bool))
def test_a_place_parses_back(namespace: str, queue: str, redis_id: str) -> None:
    where = wire.join_place(namespace, queue, redis_id)
    assert Place.parse(where) == Place(namespace, queue, redis_id)
    assert EnqueueRecord(1, 0, where).queue == (queue[:-3] if queue.endswith(".DQ") else queue)


def test_a_place_on_another_broker_names_only_its_queue() -> None:
    where = wire.join_place("", "q.DQ", "")
    assert Place.parse(where) is None and Place.queue_in(where) == "q"
    assert EnqueueRecord.decode("garbage") is None and EnqueueRecord.decode("1|x|") is None


# What the Lua scripts write -------------------------------------------------


def _raw_record(client: redis.Redis, key: str, owner: str) -> str:
    raw = client.hget(key, wire.record_field(owner))
    assert raw is not None
    return raw.decode()


def test_the_lua_scripts_write_the_record_python_decodes(redis_client: redis.Redis) -> None:
    backend = RedisBackend(client=redis_client)
    key = wire.lock_key(prefix="wire", scope="job", digest=DIGEST, phase=wire.QUEUE)
    first = wire.join_place("ns", "q.DQ", "r1")
    # _take.lua: a new, provisional slot
    backend.acquire(key, "m1", ttl=DAY, provisional=60_000, where=first)
    raw = _raw_record(redis_client, key, "m1")
    record = EnqueueRecord.decode(raw)
    assert record is not None and record.encode() == raw
    assert (record.where, record.before, record.queue) == (first, "", "q")
    assert record.provisional_until > record.taken_at > 0
    # _take.lua again: the message moved, its last place is kept
    second = wire.join_place("ns", "q", "r1")
    backend.acquire(key, "m1", ttl=DAY, provisional=60_000, where=second)
    raw = _raw_record(redis_client, key, "m1")
    moved = EnqueueRecord.decode(raw)
    assert moved is not None and moved.encode() == raw
    assert (moved.taken_at, moved.where, moved.before) == (record.taken_at, second, first)
    # confirm.lua: no longer provisional
    assert backend.confirm([(key, "m1", DAY)]) == [True]
    raw = _raw_record(redis_client, key, "m1")
    confirmed = EnqueueRecord.decode(raw)
    assert confirmed == EnqueueRecord(record.taken_at, 0, second, first) and confirmed.encode() == raw
    # what the backend's inspect reads is the same record
    info = backend.inspect(key)
    assert info is not None and info.records == {"m1": confirmed}
    # reap.lua compares the stored text to Python's encoding, whole
    assert not backend.reap(key, "m1", EnqueueRecord(record.taken_at, 0, second))
    assert backend.reap(key, "m1", confirmed)


def test_a_run_lock_records_when_it_was_taken_and_no_place(redis_client: redis.Redis) -> None:
    backend = RedisBackend(client=redis_client)
    key = wire.lock_key(prefix="wire", scope="job", digest=DIGEST, phase=wire.RUN)
    owner = wire.join_owner("m1", "t.1")
    backend.acquire(key, owner, ttl=DAY)
    raw = _raw_record(redis_client, key, owner)
    record = EnqueueRecord.decode(raw)
    assert raw.endswith("|0|\n") and record is not None and record.encode() == raw
    assert (record.provisional_until, record.where, record.before) == (0, "", "")


def test_replace_lua_writes_the_record_python_decodes(redis_client: redis.Redis) -> None:
    backend = RedisBackend(client=redis_client)
    key = wire.lock_key(prefix="wire", scope="job", digest=DIGEST, phase=wire.QUEUE)
    first, second = wire.join_place("ns", "q", "r1"), wire.join_place("ns", "q", "r2")
    backend.replace(key, "m1", ttl=DAY, lock="until_executing", superseded_ttl=DAY, where=first)
    backend.replace(key, "m2", ttl=DAY, lock="until_executing", superseded_ttl=DAY, where=second)
    raw = _raw_record(redis_client, key, "m2")
    record = EnqueueRecord.decode(raw)
    assert record is not None and record.encode() == raw
    assert (record.provisional_until, record.where, record.before) == (0, second, "")
    # a send of the same message again keeps when it was taken, and its last place
    backend.replace(key, "m2", ttl=DAY, lock="until_executing", superseded_ttl=DAY, where=first)
    raw = _raw_record(redis_client, key, "m2")
    again = EnqueueRecord.decode(raw)
    assert again == EnqueueRecord(record.taken_at, 0, first, second) and again.encode() == raw
    info = backend.inspect(key)
    assert info is not None and info.current == "m2" and info.superseded == 1


def test_the_lua_scripts_read_a_message_id_out_of_an_owner_as_python_does(redis_client: redis.Redis) -> None:
    # A release hands the key to a waiter and reserves it for the
    # waiter's message: _take.lua lets in only an owner whose message id
    # (up to its first "/") is that message's.
    backend = RedisBackend(client=redis_client)
    key = wire.lock_key(prefix="wire:é", scope="ns:job", digest=DIGEST, phase=wire.RUN)
    waiter = "mé:ssage"
    backend.acquire(key, wire.join_owner("holder", "t"), ttl=DAY)
    backend.join_line(Copy(key, waiter, 1, "handoff"), b"body", order=1, ttl=DAY)
    assert redis_client.exists(wire.waiters_key(key), wire.bodies_key(key), wire.message_key(key, waiter)) == 3
    assert backend.release(key, wire.join_owner("holder", "t")).promoted == b"body"
    assert not backend.acquire(key, wire.join_owner("other", "t"), ttl=DAY).acquired
    assert backend.acquire(key, wire.join_owner(waiter, "t/2"), ttl=DAY).acquired


def test_the_operators_parse_the_keys_the_senders_build(redis_client: redis.Redis) -> None:
    backend = RedisBackend(client=redis_client)
    prefix, actor = "wire:é", "ns:tâche"
    for phase in wire.PHASES:
        key = wire.lock_key(prefix=prefix, scope=wire.actor_scope(actor), digest=DIGEST, phase=phase)
        backend.acquire(key, wire.join_owner("m", None if phase == wire.QUEUE else "t"), ttl=DAY, where="")
    locks = sorted(LockAdmin(backend, prefix=prefix).locks(actor=actor), key=lambda lock: lock.phase)
    assert [(lock.actor, lock.digest, lock.phase) for lock in locks] == [
        (actor, DIGEST, wire.QUEUE),
        (actor, DIGEST, wire.RUN),
    ]
    assert [holder.message_id for lock in locks for holder in lock.holders] == ["m", "m"]


# One place for the option names -----------------------------------------------

PACKAGE = Path(dramatiq_unique.__file__).parent

#: Modules that another change is rewriting: they switch to the names of
#: :mod:`dramatiq_unique.model.wire` when it lands.  Empty this set then.
PENDING: set[str] = set()


def option_literals(tree: ast.AST) -> list[int]:
    """The lines of the string literals in ``tree`` that are ``unique_*``
    names (an f-string's literal parts included).
    """
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("unique_")
    ]


def test_the_option_check_finds_a_literal() -> None:
    assert option_literals(ast.parse('options.get("unique_digest")\nf"unique_{name}"\n"not unique_"')) == [1, 2]


def test_only_the_wire_module_spells_the_option_names() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name != "model/wire.py" and name not in PENDING:
            found += [f"{name}:{line}" for line in option_literals(ast.parse(path.read_text()))]
    assert found == []
    spelled = option_literals(ast.parse((PACKAGE / "model" / "wire.py").read_text()))
    assert len(spelled) == len(wire.MESSAGE_OPTIONS) + 2  # and the two actor options
