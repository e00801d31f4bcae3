"""Every lock says who holds it, since when and for what: each lock type
and strategy records its taken time and, on the Redis broker, where its
message lies, and ``locks``, ``inspect``, ``reap`` and ``release --queue``
treat every lock alike (issue 26, item 1).

The command runs as a subprocess against real Redis, on locks taken by
a real ``RedisBroker`` and, for the run locks, an in-process worker
whose actors hold them until told to finish.
"""

from __future__ import annotations

import json
import threading
import uuid
from typing import Any, Iterator

import dramatiq
import pytest
from dramatiq.brokers.redis import RedisBroker

from dramatiq_unique import UniqueMiddleware
from dramatiq_unique.ops.admin import LockAdmin
from dramatiq_unique.backends.redis import RedisBackend
from dramatiq import Worker

from tests.conftest import make_worker, wait_for
from tests.test_cli import run

#: The queue of the enqueue-side locks, which no worker consumes.
PARKED = "parked"


class App:
    """A RedisBroker under a namespace of its own, its middleware
    (recording lock args, prefix = namespace) and one actor per lock
    type and strategy.  Run-lock actors block until ``finish`` is set.
    """

    def __init__(self, redis_url: str, *, record_lock_args: bool = True) -> None:
        self.url = redis_url
        self.prefix = f"m{uuid.uuid4().hex[:8]}"
        self.broker = RedisBroker(url=redis_url, namespace=self.prefix)
        self.broker.emit_after("process_boot")
        self.unique = UniqueMiddleware(prefix=self.prefix, record_lock_args=record_lock_args, reschedule_delay=200)
        self.broker.add_middleware(self.unique)
        self.admin = LockAdmin(RedisBackend(url=redis_url), prefix=self.prefix)
        self.finish = threading.Event()
        self.running: set[str] = set()
        self.actors: dict[str, Any] = {}

    def actor(self, name: str, **options: Any) -> Any:
        def body(account_id: int) -> None:
            self.running.add(name)
            self.finish.wait(30)

        body.__name__ = name
        self.actors[name] = dramatiq.actor(body, broker=self.broker, actor_name=name, lock_args=["account_id"],
                                           max_retries=0, **options)
        return self.actors[name]

    def cli(self, *args: str) -> Any:
        result = run(*args, "--redis", self.url, "--prefix", self.prefix)
        assert result.returncode == 0, result.stdout + result.stderr
        return result

    def listed(self) -> list[dict[str, Any]]:
        return json.loads(self.cli("locks", "--json").stdout)


@pytest.fixture
def app(redis_client: Any, redis_url: str) -> Iterator[App]:
    made = App(redis_url)
    dramatiq.set_broker(made.broker)
    yield made
    made.finish.set()
    made.broker.close()


def enqueue_side(app: App) -> None:
    """One enqueue lock of every type and strategy, replace and debounce
    (each superseding a first send) and lock_limit=2 included, on a
    queue no worker consumes."""
    parked = {"queue_name": PARKED}
    app.actor("until_executing", lock="until_executing", **parked).send(1)
    app.actor("until_executed", lock="until_executed", **parked).send(1)
    app.actor("until_expired", lock="until_expired", **parked).send(1)
    app.actor("until_and_while", lock="until_and_while_executing", **parked).send(1)
    limited = app.actor("limited", lock="until_executed", lock_limit=2, **parked)
    limited.send(1), limited.send(1)
    replaced = app.actor("replaced", lock="until_executed", on_conflict="replace", **parked)
    replaced.send(1), replaced.send(1)
    debounced = app.actor("debounced", debounce=600_000, **parked)
    debounced.send(1), debounced.send(1)


def hold_run_locks(app: App) -> Any:
    """Run locks of while_executing (lock_limit 1 and 2) and
    until_and_while_executing, held by a worker until ``app.finish``."""
    app.actor("while_executing", lock="while_executing").send(42)
    limited = app.actor("while_limited", lock="while_executing", lock_limit=2)
    limited.send(7), limited.send(7)
    app.actor("both_run", lock="until_and_while_executing").send(5)
    worker = Worker(app.broker, queues={"default"}, worker_timeout=50, worker_threads=6)
    worker.start()
    wait_for(lambda: app.running >= {"while_executing", "while_limited", "both_run"}, what="run locks held")
    wait_for(lambda: sum(len(lock["holders"]) for lock in app.listed() if lock["phase"] == "run") == 4,
             what="four run-lock holders")
    return worker


def test_every_lock_type_and_strategy_shows_its_age_and_when_it_was_taken(app):
    enqueue_side(app)
    worker = hold_run_locks(app)
    try:
        listed = app.listed()
        table = app.cli("locks").stdout.splitlines()
        inspected = {lock["digest"]: app.cli("inspect", lock["digest"]).stdout for lock in listed}
    finally:
        app.finish.set()
        worker.stop()

    actors = {lock["actor"] for lock in listed}
    assert actors == {"until_executing", "until_executed", "until_expired", "until_and_while", "limited",
                      "replaced", "debounced", "while_executing", "while_limited", "both_run"}
    # The dashboard's data (LockAdmin) gives every holder its taken time.
    assert all(h["taken_at"] for lock in listed for h in lock["holders"]), listed
    # locks: an age for every lock (AGE is the sixth column), never "?" or "-".
    rows = [line.split() for line in table[1:-1]]
    assert len(rows) == len(listed)
    assert all(row[5] not in ("?", "-") and row[6] == "s" for row in rows), table
    # inspect: a "taken" line per holder.
    for lock in listed:
        text = inspected[lock["digest"]]
        assert text.count("    taken   ") == sum(len(other["holders"]) for other in listed
                                               if other["digest"] == lock["digest"]), text
    # The enqueue locks name the queue of their message.
    queue_holders = [h for lock in listed if lock["phase"] == "queue" for h in lock["holders"]]
    assert {h["queue"] for h in queue_holders} == {PARKED}


def test_a_run_lock_shows_its_lock_args_only_when_they_are_recorded(app, redis_client, redis_url):
    worker = hold_run_locks(app)
    try:
        [lock] = [lock for lock in app.listed() if lock["actor"] == "while_executing"]
        text = app.cli("inspect", lock["digest"]).stdout
    finally:
        app.finish.set()
        worker.stop()
    assert lock["lock_args"] == {"account_id": 42}
    assert 'lock args  {"account_id":42}' in text, text

    # The default path stamps and records nothing more.
    off = App(redis_url, record_lock_args=False)
    try:
        sent = off.actor("while_executing", lock="while_executing").send(42)
        worker = make_worker(off.broker, threads=1)
        wait_for(lambda: off.listed(), what="the run lock")
        [lock] = off.listed()
        off.finish.set()
        worker.stop()
    finally:
        off.finish.set()
        off.broker.close()
    assert lock["lock_args"] is None
    assert "unique_lock_args" not in sent.options


def flushed_replace_and_debounce(app: App) -> list[str]:
    """Replaced and debounced locks (and a plain one) whose queue was
    flushed: their keys."""
    replaced = app.actor("replaced", lock="until_executed", on_conflict="replace")
    replaced.send(1), replaced.send(1)
    debounced = app.actor("debounced", debounce=600_000)
    debounced.send(2), debounced.send(2)
    app.actor("debounced_serial", lock="until_and_while_executing", debounce=600_000).send(3)
    app.actor("plain", lock="until_executed").send(4)
    keys = [lock.key for lock in app.admin.locks()]
    assert len(keys) == 4
    app.broker.flush("default")
    return keys


def test_reap_finds_replaced_and_debounced_locks_whose_queue_was_flushed(app, redis_client):
    keys = flushed_replace_and_debounce(app)

    looked = json.loads(app.cli("reap", "--min-age", "0", "--json").stdout)
    assert looked["unknown"] == 0, looked
    assert sorted(s["key"] for s in looked["suspects"]) == sorted(keys)
    assert {s["queue"] for s in looked["suspects"]} == {"default"}
    reaped = json.loads(app.cli("reap", "--min-age", "0", "--yes", "--json").stdout)
    assert all(s["released"] for s in reaped["suspects"]) and len(reaped["suspects"]) == 4
    assert redis_client.exists(*keys) == 0


def test_release_queue_frees_every_enqueue_lock_of_a_flushed_queue(app, redis_client):
    keys = flushed_replace_and_debounce(app)
    app.actor("limited", lock="until_executed", lock_limit=2).send(5)
    keys += [lock.key for lock in app.admin.locks(actor="limited")]

    released = json.loads(app.cli("release", "--queue", "default", "--yes", "--json").stdout)["released"]
    assert sorted(item.split()[0] for item in released) == sorted(keys)
    assert redis_client.exists(*keys) == 0
    # And a new send of each key is accepted again.
    assert "unique_duplicate_of" not in app.actors["replaced"].send(1).options
    assert "unique_duplicate_of" not in app.actors["debounced"].send(2).options


def test_replace_records_each_holder_and_unreplace_gives_the_previous_its_record_back(backend):
    """A contract test, on both backends: replace and a re-enqueue of a
    current message keep the holder's record; a replace whose publish
    failed gives the message made current again its record back."""
    key = "p:job:{" + "d" * 32 + "}:queue"
    options = {"ttl": 60_000, "lock": "until_executed", "superseded_ttl": 60_000}
    backend.replace(key, "m1", where="ns\tq\tr1", **options)
    [first] = backend.inspect(key).records.values()
    assert (first.where, first.provisional_until) == ("ns\tq\tr1", 0) and first.taken_at > 0

    assert backend.current(key, "m1", reenter=True, ttl=60_000, lock="until_executed", where="ns\tq.DQ\tr2")[0] == 2
    moved = backend.inspect(key).records["m1"]
    assert (moved.taken_at, moved.where, moved.before) == (first.taken_at, "ns\tq.DQ\tr2", "ns\tq\tr1")

    assert backend.replace(key, "m2", where="ns\tq\tr3", **options).status == "replaced"
    assert set(backend.inspect(key).records) == {"m2"}
    assert backend.unreplace(key, "m2") == "m1"
    assert backend.inspect(key).records["m1"] == moved
