"""Valid input, property-based: digests depend on the key material and
nothing else, every valid option combination works end to end, and
each backend behaves like a model of the ``LockBackend`` contract.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any, Callable, Iterator, Optional

import pytest
import redis
from dramatiq import Actor
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from dramatiq_unique import LOCK_TYPES, STRATEGIES, DuplicateMessage, LockBackend, StubBackend, digest_for, fence_token
from dramatiq_unique.backends.records import Copy
from dramatiq_unique.backends.redis import RedisBackend
from dramatiq_unique.settings import MAX_DURATION
from tests.conftest import wait_for
from tests.test_bad_input import PARAMETERS, Rig, json_values, key_of, resolve_on_conflict, rigs

SOME = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])

#: Examples that run a worker: each waits for a real delivery.
RUNS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module", params=["stub", "redis"])
def idle_rig(request: pytest.FixtureRequest, redis_url: str) -> Iterator[Rig]:
    """A rig with no worker: what is sent stays in its queue."""
    yield from rigs(request.param, redis_url)


# Digests ------------------------------------------------------------------------------


def as_tuples(value: Any) -> Any:
    """The same material with every list a tuple."""
    if isinstance(value, (list, tuple)):
        return tuple(as_tuples(item) for item in value)
    if isinstance(value, dict):
        return {key: as_tuples(item) for key, item in value.items()}
    return value


def reordered(value: Any) -> Any:
    """The same material with every dict built in reverse order."""
    if isinstance(value, (list, tuple)):
        return type(value)(reordered(item) for item in value)
    if isinstance(value, dict):
        return {key: reordered(value[key]) for key in reversed(list(value))}
    return value


def identity(value: Any) -> Any:
    """What a lock key tells apart: JSON's types, so 1, 1.0 and True
    differ, and so do 0.0 and -0.0; a tuple is a list.
    """
    if isinstance(value, (bool, int, str)) or value is None:
        return (type(value).__name__, value)
    if isinstance(value, float):
        return ("float", repr(value))
    if isinstance(value, (list, tuple)):
        return ("list", tuple(identity(item) for item in value))
    return ("dict", tuple(sorted((key, identity(item)) for key, item in value.items())))


@pytest.fixture(scope="module")
def key_actors(idle_rig: Rig) -> dict[str, Actor[Any, Any]]:
    return {
        "all": idle_rig.declare(lock="until_executed"),
        "lock_args": idle_rig.declare(lock="until_executed", lock_args=["account_id"]),
        "lock_args_method": idle_rig.declare(lock="while_executing", lock_args_method=key_of),
        "other": idle_rig.declare(lock="until_executed"),
        "across_actors": idle_rig.declare(lock="until_executed", unique_across_actors=True),
        "across_actors_too": idle_rig.declare(lock="while_executing", unique_across_actors=True),
    }


@SOME
@given(account=json_values, requested=json_values)
def test_equal_material_gives_equal_digests_however_it_is_passed(
    key_actors: dict[str, Actor[Any, Any]], account: Any, requested: Any
) -> None:
    for name in ("all", "lock_args", "lock_args_method"):
        actor = key_actors[name]
        ways = {
            digest_for(actor, account, requested),
            digest_for(actor, account, requested_at=requested),
            digest_for(actor, requested_at=requested, account_id=account),
            digest_for(actor, as_tuples(account), as_tuples(requested)),
            digest_for(actor, reordered(account), reordered(requested)),
        }
        assert len(ways) == 1, name
    # Defaults count as passed, and arguments outside lock_args do not count
    assert digest_for(key_actors["all"], account) == digest_for(key_actors["all"], account, None)
    assert digest_for(key_actors["lock_args"], account, requested) == digest_for(key_actors["lock_args"], account, 0)


@SOME
@given(first=json_values, second=json_values)
def test_different_material_gives_different_digests(
    key_actors: dict[str, Actor[Any, Any]], first: Any, second: Any
) -> None:
    same = identity(first) == identity(second)
    event("equal material" if same else "different material")
    for name in ("all", "lock_args", "lock_args_method"):
        actor = key_actors[name]
        assert (digest_for(actor, first) == digest_for(actor, second)) == same, name
    # Another actor never shares a key, unless both lock across actors
    assert digest_for(key_actors["all"], first) != digest_for(key_actors["other"], first)
    shared = digest_for(key_actors["across_actors"], first), digest_for(key_actors["across_actors_too"], first)
    assert shared[0] == shared[1]


def test_values_json_tells_apart_lock_apart(key_actors: dict[str, Actor[Any, Any]]) -> None:
    values: list[Any] = [0, 0.0, -0.0, False, None, "0", "", "false", "null", [], {}, [0], {"0": 0}, [[]], "[]"]
    values += [1, True, 1.0, "1", [1], {"1": 1}, [None], {"": None}, {"a": 1, "b": 2}, {"a": 2, "b": 1}]
    digests = [digest_for(key_actors["all"], value) for value in values]
    assert len(set(digests)) == len(values)


# Valid option combinations ------------------------------------------------------------


@st.composite
def valid_options(draw: st.DrawFn, replace: bool = True) -> dict[str, Any]:
    """Any combination of actor options the README allows; without the
    client strategy ``replace`` (which never refuses a send: see
    ``tests/test_replace.py``) when ``replace`` is False.
    """
    lock = draw(st.sampled_from(list(LOCK_TYPES)))
    sides = LOCK_TYPES[lock].sides
    strategies = {side: [n for n in STRATEGIES[side] if replace or n != "replace"] for side in sides}
    options: dict[str, Any] = {"lock": lock}
    form = draw(st.sampled_from(["default", "one name", "per side"]))
    if form == "one name":
        options["on_conflict"] = draw(st.sampled_from(sorted(set.intersection(*(set(strategies[s]) for s in sides)))))
    elif form == "per side":
        options["on_conflict"] = draw(
            st.fixed_dictionaries({}, optional={side: st.sampled_from(strategies[side]) for side in sides})
        )
    key = draw(st.sampled_from(["all", "lock_args", "lock_args_method"]))
    if key == "lock_args":
        names = st.lists(st.sampled_from(PARAMETERS), unique=True)
        options["lock_args"] = draw(names.map(tuple) | names)
    elif key == "lock_args_method":
        options["lock_args_method"] = key_of
    replacing = resolve_on_conflict(lock, options.get("on_conflict")) or {}
    # A replacing send supersedes the one holder of its key.
    options["lock_limit"] = draw(st.none() | st.integers(1, 1 if replacing.get("client") == "replace" else 3))
    if LOCK_TYPES[lock].queue_lock:
        options["lock_ttl"] = draw(st.none() | st.integers(60_000, MAX_DURATION))
    resolved = resolve_on_conflict(lock, options.get("on_conflict"))
    assert resolved is not None
    if resolved.get("server") == "reschedule":
        options["reschedule_delay"] = draw(st.none() | st.integers(0, 5_000))
    options["unique_across_queues"] = draw(st.none() | st.booleans())
    options["unique_across_actors"] = draw(st.none() | st.booleans())
    return options


def lock_key(rig: Rig, actor: Actor[Any, Any], phase: str, *args: Any) -> str:
    spec = rig.unique.specs[actor.actor_name]
    return rig.unique.key(spec, digest_for(actor, *args), phase)


@SOME
@given(options=valid_options(replace=False), account=json_values)
def test_a_valid_combination_takes_limit_enqueue_locks_and_refuses_the_next(
    idle_rig: Rig, options: dict[str, Any], account: Any
) -> None:
    # Given an actor declared with any valid combination of options
    actor = idle_rig.declare(**options)
    spec = idle_rig.unique.specs[actor.actor_name]
    limit = options["lock_limit"] or 1
    try:
        # When one more message than its limit is sent for one key
        accepted, refusals = [], []
        for _ in range(limit + 1):
            try:
                message = actor.send(account, 1.5)
            except DuplicateMessage as duplicate:
                refusals.append(("raise", duplicate.holder))
                continue
            if "unique_duplicate_of" in message.options:
                refusals.append(("log", message.options["unique_duplicate_of"]))
            else:
                accepted.append(message)
        ids = {message.message_id for message in accepted}
        if not spec.lock.queue_lock:
            # Then a lock without an enqueue lock enqueues them all
            assert len(accepted) == limit + 1 and idle_rig.locks() == []
        else:
            # Then exactly limit are enqueued, each holding a slot, and the
            # last is refused the way client says, naming a holder
            assert len(accepted) == limit and idle_rig.queued() == limit
            info = idle_rig.inspect(lock_key(idle_rig, actor, "queue", account, 1.5))
            assert info is not None and set(info.holders) == ids and info.lock == spec.lock.name
            ((strategy, holder),) = refusals
            assert strategy == spec.client and holder in ids
            assert idle_rig.locks() == [info.key]
        assert idle_rig.queued() == len(accepted)
    finally:
        idle_rig.reset()


@RUNS
@given(options=valid_options(), account=json_values)
def test_a_valid_combination_runs_and_leaves_the_lock_state_its_type_promises(
    idle_rig: Rig, options: dict[str, Any], account: Any
) -> None:
    runs: list[Optional[int]] = []
    done = threading.Event()

    def balance_sync(account_id: Any, requested_at: Any = None) -> None:
        runs.append(fence_token())
        done.set()

    # Given an actor declared with any valid combination of options
    rig = idle_rig
    actor = rig.declare(balance_sync, **options)
    spec = rig.unique.specs[actor.actor_name]
    event(spec.lock.name)
    try:
        # When one message is sent and a worker runs it
        message = actor.send(account, 1.5)
        assert "unique_duplicate_of" not in message.options
        with rig.running():
            wait_for(done.is_set, what="the run")
            rig.drain()
        # Then it ran once, holding a fenced run lock exactly when its type has one
        assert len(runs) == 1
        assert isinstance(runs[0], int) == spec.lock.run_lock
        # And only until_expired still holds its enqueue lock, owned by the message
        if spec.lock.queue_release == "expiry":
            info = rig.inspect(lock_key(rig, actor, "queue", account, 1.5))
            assert info is not None and set(info.holders) == {message.message_id}
            assert rig.locks() == [info.key]
        else:
            assert rig.locks() == []
        assert rig.queued() == 0
    finally:
        rig.reset()


# The backends against a model ------------------------------------------------------------


def test_releasing_the_last_live_holder_drops_the_key_beside_a_lapsed_one(backend: LockBackend) -> None:
    # Found by the model below: release.lua counted the lapsed holder as
    # one, so the key stayed listed, with nobody holding it, until it
    # expired (after up to the 24 h enqueue-lock ttl).
    key = "lapse:actor:{digest}:queue"
    backend.acquire(key, "live", ttl=LONG, limit=2)
    backend.acquire(key, "lapsed", ttl=1, limit=2)
    wait_for(lambda: set(getattr(backend.inspect(key), "holders", ())) == {"live"}, what="the short slot to lapse")
    assert backend.release(key, "live").held
    assert backend.inspect(key) is None
    assert list(backend.scan("lapse:*")) == []


KEYS = ("k0", "k1")
OWNERS = ("a", "b", "c")
MESSAGES = ("m0", "m1", "m2")
VIAS = ("", "delay", "handoff")

#: Long enough that no slot lapses unless a rule makes it.
LONG = 600_000


class BackendModel(RuleBasedStateMachine):
    """The ``LockBackend`` contract as a model: per key, the set of
    holders, the last fence, what was recorded, and the waiters.

    ``lapsed`` holds owners whose slot ran out: their entry may linger
    until the backend next cleans the key, so releasing one frees
    nothing and may or may not hand a waiter the slot.
    """

    make_backend: Callable[[], LockBackend]

    def __init__(self) -> None:
        super().__init__()
        self.backend = type(self).make_backend()
        self.prefix = f"model-{uuid.uuid4().hex[:8]}"
        self.holders: dict[str, set[str]] = {key: set() for key in KEYS}
        self.lapsed: dict[str, set[str]] = {key: set() for key in KEYS}
        self.fence = dict.fromkeys(KEYS, 0)
        self.lock: dict[str, Optional[str]] = dict.fromkeys(KEYS)
        self.args: dict[str, Optional[str]] = dict.fromkeys(KEYS)
        self.waiting: dict[str, dict[str, int]] = {key: {} for key in KEYS}
        #: key -> message id -> [attempt, winner], the message records
        self.records: dict[str, dict[str, list[Any]]] = {key: {} for key in KEYS}

    def full(self, key: str) -> str:
        return f"{self.prefix}:actor:{{{key}}}:run"

    def _emptied(self, key: str) -> None:
        if not self.holders[key]:
            self.lock[key] = self.args[key] = None

    def _new_holder(self, key: str, owner: str, fence: int, lock: str, lock_args: Optional[str]) -> None:
        assert fence > self.fence[key], "fencing tokens must grow with every new holder"
        if not self.holders[key]:
            self.args[key] = None
        self.holders[key].add(owner)
        self.fence[key], self.lock[key] = fence, lock
        if lock_args is not None:
            self.args[key] = lock_args

    @rule(
        key=st.sampled_from(KEYS),
        owner=st.sampled_from(OWNERS),
        limit=st.integers(1, 3),
        lock=st.sampled_from(list(LOCK_TYPES)),
        lock_args=st.none() | st.sampled_from(['{"account_id":1}', '{"account_id":2}']),
    )
    def acquire(self, key: str, owner: str, limit: int, lock: str, lock_args: Optional[str]) -> None:
        held = self.holders[key]
        got = self.backend.acquire(self.full(key), owner, ttl=LONG, limit=limit, lock=lock, lock_args=lock_args)
        self.lapsed[key].clear()  # every acquire drops lapsed entries first
        if owner in held:
            assert got.acquired and got.reentered and got.fence == self.fence[key]
        elif len(held) >= limit:
            assert not got.acquired and got.holder in held
        else:
            assert got.acquired and not got.reentered
            self._new_holder(key, owner, got.fence, lock, lock_args)

    @precondition(lambda self: any(self.holders.values()))
    @rule(data=st.data())
    def acquire_again_with_a_shorter_ttl(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from([key for key in KEYS if self.holders[key]]))
        owner = data.draw(st.sampled_from(sorted(self.holders[key])))
        before = self._deadline(key, owner)
        got = self.backend.acquire(self.full(key), owner, ttl=LONG // 100, limit=1)
        self.lapsed[key].clear()
        assert got.acquired and got.reentered and got.fence == self.fence[key]
        # The later of the two deadlines is kept (a few ms of clock jitter aside)
        assert self._deadline(key, owner) >= before - 5

    def _deadline(self, key: str, owner: str) -> int:
        info = self.backend.inspect(self.full(key))
        assert info is not None
        return info.holders[owner]

    @precondition(lambda self: any(len(self.holders[key]) < 3 for key in KEYS))
    @rule(data=st.data())
    def lapse(self, data: st.DataObject) -> None:
        # A holder whose slot runs out frees it for others
        key = data.draw(st.sampled_from([key for key in KEYS if len(self.holders[key]) < 3]))
        owner = data.draw(st.sampled_from([owner for owner in OWNERS if owner not in self.holders[key]]))
        got = self.backend.acquire(self.full(key), owner, ttl=1, limit=3, lock="while_executing")
        self.lapsed[key].clear()
        assert got.acquired and not got.reentered
        assert got.fence > self.fence[key]
        self.fence[key] = got.fence
        self.lock[key] = "while_executing" if self.holders[key] else None
        wait_for(lambda: self._lapsed(key, owner), what="the lapse")
        self.lapsed[key].add(owner)
        self._emptied(key)

    def _lapsed(self, key: str, owner: str) -> bool:
        # Redis expires a key 1 ms after its last deadline, when acquire
        # already counts that holder out: wait until both agree.
        info = self.backend.inspect(self.full(key))
        if info is not None and owner in info.holders:
            return False
        return bool(self.holders[key]) or self.full(key) not in set(self.backend.scan(self.full(key)))

    @rule(key=st.sampled_from(KEYS), owner=st.sampled_from(OWNERS))
    def release(self, key: str, owner: str) -> None:
        held, lingering = owner in self.holders[key], owner in self.lapsed[key]
        # (the slot handed to a waiter is reserved for its message for 1 ms: reservations are
        # tests/test_backends.py's, this model's keys are free again for every owner once it ran out)
        got = self.backend.release(self.full(key), owner, reserve=1)
        time.sleep(0.003)
        # Only a holder frees a slot; a stranger's release changes nothing
        assert got.held == held
        self.holders[key].discard(owner)
        self.lapsed[key].discard(owner)
        self._emptied(key)
        if not (held or lingering) or not self.waiting[key]:
            assert got.promoted is None
            return
        if got.promoted is None:
            assert lingering, "a release by a holder hands the slot to a waiter"
            return
        first = min(self.waiting[key].values())
        message_id = got.promoted.decode()
        assert self.waiting[key].get(message_id) == first, "the longest waiter is promoted"
        del self.waiting[key][message_id]

    @rule(pairs=st.lists(st.tuples(st.sampled_from(KEYS), st.sampled_from(OWNERS)), min_size=1, max_size=4))
    def extend(self, pairs: list[tuple[str, str]]) -> None:
        got = self.backend.extend([(self.full(key), owner) for key, owner in pairs], LONG)
        assert got == [owner in self.holders[key] for key, owner in pairs]

    @rule(key=st.sampled_from(KEYS))
    def delete(self, key: str) -> None:
        got = self.backend.delete(self.full(key))
        if self.holders[key]:
            assert got
        elif not self.lapsed[key]:
            assert not got
        self.holders[key].clear()
        self.lapsed[key].clear()
        self._emptied(key)

    def copy(self, key: str, message_id: str, attempt: int, via: str) -> Copy:
        return Copy(self.full(key), message_id, attempt, via)

    @rule(key=st.sampled_from(KEYS), message_id=st.sampled_from(MESSAGES), attempt=st.integers(1, 3),
          order=st.integers(0, 3))
    def wait(self, key: str, message_id: str, attempt: int, order: int) -> None:
        copy = self.copy(key, message_id, attempt, "handoff")
        self.backend.join_line(copy, message_id.encode(), order=order, ttl=LONG)
        record = self.records[key].get(message_id)
        if record is not None and attempt <= record[0]:
            return  # only the winner of attempt - 1 waits for attempt: this one was sent again, and changes nothing
        self.waiting[key][message_id] = order
        self.records[key][message_id] = [attempt, "", record[2] if record is not None else None]

    @rule(key=st.sampled_from(KEYS), message_id=st.sampled_from(MESSAGES), attempt=st.integers(0, 3),
          via=st.sampled_from(VIAS))
    def claim(self, key: str, message_id: str, attempt: int, via: str) -> None:
        got = self.backend.claim(self.copy(key, message_id, attempt, via))
        record = self.records[key].get(message_id)
        if record is None:
            assert got is True, "a copy with no record runs"
        elif attempt < record[0]:
            assert got is False, "a copy of an earlier reschedule is stale"
        elif attempt == record[0] and record[1]:
            assert got == (record[1] == via), "only the winner of a reschedule, and its copies, run"
        else:
            assert got is True, "the first copy of a reschedule wins it"
        if got and record is not None:
            # a claim retires the copy in its message's stead, as the winner of its attempt; the
            # message is not finished (a replay of the copy runs), and the same copy claiming again still wins
            record[:] = [attempt, via, None]
            self.waiting[key].pop(message_id, None)

    @invariant()
    def inspect_and_scan_show_the_model(self) -> None:
        for key in KEYS:
            info = self.backend.inspect(self.full(key))
            if not self.holders[key]:
                assert info is None
                continue
            assert info is not None
            assert set(info.holders) == self.holders[key]
            assert (info.lock, info.lock_args, info.fence) == (self.lock[key], self.args[key], self.fence[key])
        # Waiting lists live beside their lock: RedisBackend lists them too
        listed = {key for key in self.backend.scan(f"{self.prefix}:*") if key.endswith((":run", ":queue"))}
        assert listed == {self.full(key) for key in KEYS if self.holders[key]}

    def teardown(self) -> None:
        for key in KEYS:
            self.backend.delete(self.full(key))
        if isinstance(self.backend, RedisBackend):
            for name in self.backend.client.scan_iter(match=f"{self.prefix}:*"):
                self.backend.client.delete(name)


MODEL = settings(max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


#: Fewer examples on PostgreSQL, whose calls each commit a transaction.
POSTGRES_MODEL = settings(MODEL, max_examples=25)


@pytest.mark.parametrize("kind", ["stub", "redis", "postgres"])
def test_the_backend_behaves_like_the_model(kind: str, redis_url: str, request: pytest.FixtureRequest) -> None:
    client = redis.Redis.from_url(redis_url)
    backend_for: dict[str, Callable[[], LockBackend]] = {
        "stub": StubBackend,
        "redis": lambda: RedisBackend(client=client),
    }
    if kind == "postgres":
        shared = request.getfixturevalue("postgres_backend")
        backend_for[kind] = lambda: shared

    class Model(BackendModel):
        make_backend = staticmethod(backend_for[kind])  # type: ignore[assignment]

    try:
        run_state_machine_as_test(Model, settings=POSTGRES_MODEL if kind == "postgres" else MODEL)
    finally:
        client.close()
