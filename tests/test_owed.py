"""Releases a stopping worker could not send, written to the broker and
made by the next worker (``dramatiq_unique.worker.resend``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import dramatiq
import pytest
from dramatiq.brokers.stub import StubBroker

from dramatiq_unique import StubBackend, UniqueMiddleware
from dramatiq_unique.worker.resend import OWED_ACTOR, OwedRelease
from tests.conftest import make_worker, wait_for


class FlakyBackend(StubBackend):
    """A stub backend whose releases fail while ``down`` is set."""

    down = False

    def release(self, key, owner, **options):  # type: ignore[no-untyped-def]
        if self.down:
            raise ConnectionError("the lock backend is unreachable")
        return super().release(key, owner, **options)


class RefusingBroker(StubBroker):
    """A stub broker that refuses every enqueue of the owed actor."""

    def enqueue(self, message: Any, *, delay: Any = None) -> Any:
        if message.actor_name == OWED_ACTOR:
            raise ConnectionError("the broker is unreachable too")
        return super().enqueue(message, delay=delay)


def setup(broker: StubBroker, backend: StubBackend) -> tuple[UniqueMiddleware, dramatiq.Actor]:
    unique = UniqueMiddleware(backend=backend, shutdown_timeout=300)
    broker.add_middleware(unique)
    broker.emit_after("process_boot")

    def once(key: int) -> None:
        pass

    return unique, dramatiq.actor(once, broker=broker, lock="until_executed", max_retries=0)


def owed_messages(broker: StubBroker) -> list[Any]:
    return [m for q in broker.queues.values() for m in list(q.queue) if OWED_ACTOR.encode() in m]


def test_a_release_owed_at_shutdown_is_written_to_the_broker_and_made_by_the_next_worker() -> None:
    # Given a worker whose lock backend stops answering releases, after an until_executed job ran
    broker, backend = StubBroker(), FlakyBackend()
    unique, once = setup(broker, backend)
    worker = make_worker(broker, threads=1)
    backend.down = True
    message = once.send(1)
    broker.join(once.queue_name)
    worker.join()
    assert once.send(1).options["unique_duplicate_of"] == message.message_id
    # When the worker stops within its bound, with that release still owed
    started = time.monotonic()
    worker.stop()
    assert time.monotonic() - started < 2
    # Then the release was written to the broker, on the actor's queue
    assert len(owed_messages(broker)) == 1
    # And once the backend answers again, the next worker makes it: the key is free
    backend.down = False
    worker = make_worker(broker, threads=1)
    try:
        wait_for(lambda: "unique_duplicate_of" not in once.send(1).options, timeout=10, what="the key to be free")
    finally:
        worker.stop()
        broker.close()


#: Keys of the middleware's own locks: an owed release names no other.
KEY, GONE = "dramatiq-unique:once:{k}:queue", "dramatiq-unique:once:{gone}:queue"


def test_an_owed_release_the_backend_still_refuses_is_enqueued_again_later_until_its_lock_expires() -> None:
    broker, backend = StubBroker(), FlakyBackend()
    unique, once = setup(broker, backend)
    unique.before_worker_boot(broker, None)
    assert backend.acquire(KEY, "m", ttl=60_000).acquired
    backend.down = True
    # When an owed release is made while the backend is still down
    unique.owed.make([OwedRelease.within(KEY, "m", 60_000).encode(), OwedRelease.within(GONE, "m", -1).encode()])
    # Then it is enqueued again with a delay, and the one whose lock expired is dropped
    [again] = list(broker.queues[f"{once.queue_name}.DQ"].queue)
    decoded = dramatiq.Message.decode(again)
    assert [r["key"] for r in decoded.args[0]] == [KEY] and decoded.kwargs == {"attempt": 1}
    # And made again once the backend is back, the release lands
    backend.down = False
    unique.owed.make(*decoded.args, **decoded.kwargs)
    assert backend.inspect(KEY) is None
    broker.close()


def test_an_owed_release_made_twice_frees_only_its_own_owner() -> None:
    broker, backend = StubBroker(), FlakyBackend()
    unique, _ = setup(broker, backend)
    unique.before_worker_boot(broker, None)
    assert backend.acquire(KEY, "m", ttl=60_000).acquired
    owed = [OwedRelease.within(KEY, "m", 60_000).encode()]
    unique.owed.make(owed)
    # When another message takes the key, and the same owed release is made again (a duplicate)
    assert backend.acquire(KEY, "other", ttl=60_000).acquired
    unique.owed.make(owed)
    # Then the new holder keeps it: the release checks its owner
    info = backend.inspect(KEY)
    assert info is not None and list(info.holders) == ["other"]
    broker.close()


def test_when_the_broker_refuses_too_each_owed_release_is_named_in_an_error(caplog: pytest.LogCaptureFixture) -> None:
    # Given a worker whose lock backend and broker both refuse, with a release owed
    broker, backend = RefusingBroker(), FlakyBackend()
    unique, once = setup(broker, backend)
    worker = make_worker(broker, threads=1)
    backend.down = True
    once.send(1)
    broker.join(once.queue_name)
    worker.join()
    # When it stops
    started = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="dramatiq_unique"):
        worker.stop()
    # Then it stops within its bound, and an ERROR names the key it leaves to its lock_ttl
    assert time.monotonic() - started < 2
    errors = [r for r in caplog.records if "could not be released before shutdown" in r.getMessage()]
    assert len(errors) == 1 and ":once:" in errors[0].getMessage()
    assert "the broker did not take them" in errors[0].getMessage()
    broker.close()


def test_an_owed_release_with_a_long_reserve_is_made() -> None:
    # A reschedule delay of 10 minutes reserves a handed slot for 20: its owed release carries that reserve
    broker, backend = StubBroker(), FlakyBackend()
    unique, _ = setup(broker, backend)
    unique.before_worker_boot(broker, None)
    assert backend.acquire(KEY, "m", ttl=60_000).acquired
    unique.owed.make([OwedRelease.within(KEY, "m", 60_000, {"succeeded": True, "reserve": 1_201_000}).encode()])
    assert backend.inspect(KEY) is None
    broker.close()
