"""Options a message carries: a hand-made or forged ``unique_*`` option
never crashes or stalls a worker thread and never loses another message;
the message runs, with a WARNING that names the option.  A forged but
well-formed digest runs the message under that digest's key, and can
release no lock of another message (see docs/reliability.md, "Options a
message carries").  A hand-made message of the internal owed-releases
actor releases nothing outside the middleware's own locks.

On a StubBroker with real in-process worker threads, and the suite's Redis.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any, Iterator

import dramatiq
import pytest
import redis
from dramatiq import Message

from dramatiq_unique.backends.redis import RedisBackend
from dramatiq_unique.worker.resend import OWED_ACTOR
from tests.conftest import make_worker, unique, wait_for


class Rig:
    """A broker, a middleware on the suite's Redis, two actors, and the runs they record."""

    def __init__(self, broker: dramatiq.Broker, redis_client: redis.Redis) -> None:
        self.prefix = f"t-{uuid.uuid4().hex[:10]}"
        self.broker, self.backend = broker, RedisBackend(client=redis_client)
        self.unique = unique(self.backend, prefix=self.prefix)
        broker.add_middleware(self.unique)
        self.runs: list[tuple[str, Any, float, float]] = []
        self.gate = threading.Event()

        def sync(account_id: Any, hold: bool = False) -> None:
            began = time.monotonic()
            if hold:
                self.gate.wait(10)
            self.runs.append(("sync", account_id, began, time.monotonic()))

        def once(account_id: Any) -> None:
            self.runs.append(("once", account_id, time.monotonic(), time.monotonic()))

        self.sync = dramatiq.actor(sync, broker=broker, lock="while_executing", on_conflict="reschedule",
                                   lock_args=["account_id"], max_retries=0)
        self.once = dramatiq.actor(once, broker=broker, lock="until_executed", max_retries=0)

    def key(self, actor: Any, account_id: Any, phase: str) -> str:
        spec = self.unique.specs[actor.actor_name]
        return self.unique.key(spec, spec.digest((account_id,), {}), phase)

    def hand_made(self, actor: Any, *args: Any, **options: Any) -> Message[Any]:
        """A message put on the queue as anyone who can write to the broker could: past every middleware."""
        message: Message[Any] = Message(queue_name=actor.queue_name, actor_name=actor.actor_name, args=args,
                                        kwargs={}, options=options)
        self.broker.queues[actor.queue_name].put(message.encode())  # what StubBroker.enqueue does after its hooks
        return message


@pytest.fixture
def rig(stub_broker: dramatiq.Broker, redis_client: redis.Redis) -> Iterator[Rig]:
    rig = Rig(stub_broker, redis_client)
    worker = make_worker(stub_broker, threads=4)
    try:
        yield rig
    finally:
        rig.gate.set()
        worker.stop()
        rig.backend.delete_prefix(f"{rig.prefix}:")


MALFORMED = [
    ("unique_waits", -1), ("unique_waits", "3"), ("unique_waits", 10**12), ("unique_reschedules", True),
    ("unique_reschedules", -5), ("unique_reschedules", 2.5), ("unique_via", "evil"), ("unique_via", None),
    ("unique_digest", 123), ("unique_digest", "../other"), ("unique_digest", "A" * 32), ("unique_seq", [1]),
    ("unique_lock_args", "x" * 70_000), ("unique_lock_args", {"account_id": 1}),
]


@pytest.mark.parametrize(("name", "value"), MALFORMED, ids=[f"{n}={str(v)[:12]}" for n, v in MALFORMED])
def test_a_malformed_option_is_dropped_and_the_message_runs_once(rig: Rig, caplog, name: str, value: Any) -> None:
    caplog.set_level(logging.WARNING)
    # Given a hand-made message of a while_executing actor with one malformed option, then a normal send
    forged = rig.hand_made(rig.sync, 7, **{name: value})
    normal = rig.sync.send(7)
    # Then both run, each once, one after the other, and the key is free again
    wait_for(lambda: len(rig.runs) == 2, what="both messages to run")
    rig.broker.join(rig.sync.queue_name)
    assert [run[1] for run in rig.runs] == [7, 7]
    (_, _, first_start, first_end), (_, _, second_start, _) = sorted(rig.runs, key=lambda run: run[2])
    assert first_end <= second_start
    wait_for(lambda: rig.backend.inspect(rig.key(rig.sync, 7, "run")) is None, what="the run lock to be released")
    # And the warning names the option and the message
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Ignored option")]
    assert len(warned) == 1 and warned[0].startswith(f"Ignored option {name}=") and forged.message_id in warned[0]
    assert normal.message_id not in " ".join(warned)


def test_a_forged_digest_runs_under_that_key_and_releases_no_other_messages_lock(rig: Rig) -> None:
    # Given an until_executed message waiting in the queue of a stopped consumer: its enqueue lock is held
    victim_key = rig.key(rig.once, 1, "queue")
    spec = rig.unique.specs[rig.once.actor_name]
    assert rig.backend.acquire(victim_key, "victim-message", ttl=60_000, lock="until_executed").acquired
    # When a hand-made message of another account carries that key's digest
    forged = rig.hand_made(rig.once, 2, unique_digest=spec.digest((1,), {}))
    wait_for(lambda: len(rig.runs) == 1, what="the forged message to run")
    rig.broker.join(rig.once.queue_name)
    # Then it ran, once, and the victim's lock is still the victim's: a release checks its owner
    assert [run[1] for run in rig.runs] == [2]
    info = rig.backend.inspect(victim_key)
    assert info is not None and list(info.holders) == ["victim-message"]
    # And a forged run-lock digest serializes with that key's runs instead of its own: no overlap on the key
    rig.runs.clear()
    rig.sync.send(1, hold=True)
    wait_for(lambda: rig.backend.inspect(rig.key(rig.sync, 1, "run")) is not None, what="the holder to take key 1")
    forged = rig.hand_made(rig.sync, 3, unique_digest=rig.unique.specs[rig.sync.actor_name].digest((1,), {}))
    # it meets key 1 held, and waits in key 1's line
    wait_for(lambda: [w.message_id for w in rig.backend.waiters(rig.key(rig.sync, 1, "run"))] == [forged.message_id],
             what="the forged message to wait for key 1")
    assert rig.runs == []
    rig.gate.set()
    wait_for(lambda: len(rig.runs) == 2, timeout=15, what="the holder, then the forged message")
    first, second = sorted(rig.runs, key=lambda run: run[2])
    assert first[1] == 1 and second[1] == 3 and first[3] <= second[2]


def test_a_hand_made_owed_release_releases_nothing_outside_the_middlewares_locks(rig: Rig, caplog,
                                                                                   redis_client) -> None:
    caplog.set_level(logging.WARNING)
    # Given a lock of another application in the same Redis, and a run lock of this middleware
    other = f"other-app-{uuid.uuid4().hex[:8]}:lock:run"
    assert rig.backend.acquire(other, "their-owner", ttl=60_000).acquired
    mine = rig.key(rig.sync, 9, "run")
    assert rig.backend.acquire(mine, "my-owner", ttl=60_000).acquired
    rig.unique.owed.declare(rig.broker, rig.sync.queue_name)
    owed = rig.broker.actors[OWED_ACTOR]
    until = int(time.time() * 1000) + 60_000
    # When hand-made owed releases name the other key, bad keywords, and a malformed entry
    releases = [
        {"key": other, "owner": "their-owner", "until": until, "options": {}},
        {"key": mine, "owner": "my-owner", "until": until, "options": {"hand_over": False, "reserve": -1}},
        {"key": mine, "owner": "my-owner", "until": "soon"},
        "not a release",
    ]
    owed.send(releases)
    wait_for(lambda: sum("Ignored an owed release" in r.getMessage() for r in caplog.records) == 4,
             what="four refusals")
    rig.broker.join(rig.sync.queue_name)
    # Then nothing was released
    assert rig.backend.inspect(other) is not None and rig.backend.inspect(mine) is not None
    redis_client.delete(other)
