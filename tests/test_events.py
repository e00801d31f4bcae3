"""Lifecycle events and log lines, with a real worker on the Stub and
the Redis broker.

Every test here also checks, through ``log_lines``, that each record
the package logged is a row of ``LOG_LINES`` at its documented level.
"""

from __future__ import annotations

import ast
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import dramatiq
import pytest
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import MiddlewareError

from dramatiq_unique import LockBackendError, LockEvent, UniqueMiddleware, digest_for
from dramatiq_unique.backends.redis import RedisBackend
from dramatiq_unique.events import LOG_LINES
from dramatiq_unique.testing import wait_for_releases
from tests.conftest import free_port, make_worker, start_redis_server, unique, wait_for

PACKAGE = Path(__file__).resolve().parent.parent / "dramatiq_unique"

#: The modules whose log lines ``LOG_LINES`` documents: the middleware at run time.
RUNTIME_MODULES = (
    "middleware.py", "send/guard.py", "worker/take.py", "worker/release.py", "worker/leases.py",
    "events.py", "model/spec.py", "send/confirm.py",
    "worker/reap.py", "worker/resend.py", "send/context.py",
)


@dataclass
class Recorder:
    """A listener that keeps every event."""

    mutex: threading.Lock = field(default_factory=threading.Lock)
    events: list[LockEvent] = field(default_factory=list)

    def __call__(self, event: LockEvent) -> None:
        with self.mutex:
            self.events.append(event)

    def story(self, suffix: str = "") -> list[tuple[str, Optional[str]]]:
        """(name, message id) of the events on keys ending in ``suffix``,
        with repeats in a row collapsed.
        """
        with self.mutex:
            pairs = [(e.name, e.message_id) for e in self.events if e.key.endswith(suffix)]
        return [pair for i, pair in enumerate(pairs) if i == 0 or pairs[i - 1] != pair]

    def named(self, name: str) -> list[LockEvent]:
        with self.mutex:
            return [e for e in self.events if e.name == name]


class Setup:
    def __init__(self, broker: dramatiq.Broker, middleware: UniqueMiddleware, recorder: Recorder) -> None:
        self.broker, self.unique, self.recorder = broker, middleware, recorder
        self.worker: Optional[dramatiq.Worker] = None

    def start(self, threads: int = 4) -> None:
        self.worker = make_worker(self.broker, threads)

    def drain(self) -> None:
        assert self.worker is not None
        if isinstance(self.broker, StubBroker):
            self.broker.join("default", fail_fast=False)
        else:
            self.broker.join("default", timeout=30_000)
        self.worker.join()
        wait_for_releases(self.unique)

    def actor(self, fn: Any, **options: Any) -> dramatiq.Actor:
        return dramatiq.actor(fn, broker=self.broker, actor_name=f"{fn.__name__}_{uuid.uuid4().hex[:6]}", **options)

    def key(self, actor: dramatiq.Actor, phase: str, *args: Any) -> str:
        return self.unique.key(self.unique.specs[actor.actor_name], digest_for(actor, *args), phase)


@pytest.fixture
def setup(any_broker: dramatiq.Broker) -> Iterator[Setup]:
    broker = any_broker
    recorder = Recorder()
    middleware = unique(listeners=[recorder])
    broker.add_middleware(middleware)
    rig = Setup(broker, middleware, recorder)
    yield rig
    if rig.worker is not None:
        rig.worker.stop()


@pytest.fixture(autouse=True)
def log_lines(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Capture the package's records, and check each is documented."""
    caplog.set_level(logging.DEBUG, logger="dramatiq_unique")
    yield caplog
    documented = {(line.level, line.logger, line.template) for line in LOG_LINES}
    for record in caplog.records:
        if record.name.startswith("dramatiq_unique"):
            assert (record.levelname, record.name, record.msg) in documented, f"undocumented log line: {record}"


def logged(caplog: pytest.LogCaptureFixture, level: str, template: str) -> list[logging.LogRecord]:
    assert any(line.level == level and line.template == template for line in LOG_LINES), template
    return [r for r in caplog.records if r.levelname == level and r.msg == template]


# Enqueue locks ------------------------------------------------------------


def test_an_enqueue_lock_is_locked_refused_then_released(setup, log_lines):
    # Given an until_executed actor sent twice for one key
    def sync(account_id):
        pass

    actor = setup.actor(sync, lock="until_executed")
    first, second = actor.send(1), actor.send(1)
    # When the first runs
    setup.start()
    setup.drain()
    # Then its lock was taken, refused to the second send, and released
    key = setup.key(actor, "queue", 1)
    assert setup.recorder.story() == [("locked", first.message_id), ("duplicate", second.message_id),
                                      ("released", first.message_id)]
    assert {(e.actor, e.key) for e in setup.recorder.events} == {(actor.actor_name, key)}
    assert setup.recorder.named("duplicate")[0].holder == first.message_id
    # And the refusal was logged at INFO, naming the holder
    [refused] = logged(log_lines, "INFO", "Duplicate %s not enqueued: lock %r is held by message %s.")
    assert refused.args[1:] == (key, first.message_id)
    assert setup.unique.events.count("duplicate", actor.actor_name) == 1


def test_a_lapsed_enqueue_lock_is_reported_lost(setup, log_lines):
    # Given a message whose 200 ms enqueue lock lapsed while it waited, and a second send that took the key
    def sync(account_id):
        pass

    actor = setup.actor(sync, lock="until_executed", lock_ttl=200)
    first = actor.send(1)
    wait_for(lambda: setup.unique.backend.inspect(setup.key(actor, "queue", 1)) is None, what="the lock to lapse")
    second = actor.send(1)
    # When both run
    setup.start()
    setup.drain()
    # Then the first learns its lock was lost, and the second releases its own
    assert setup.recorder.story()[:2] == [("locked", first.message_id), ("locked", second.message_id)]
    assert sorted(setup.recorder.story()[2:]) == [("lock_lost", first.message_id), ("released", second.message_id)]
    [lapsed] = logged(log_lines, "WARNING", "Lock %r of message %s lapsed before it was released: raise its lock_ttl.")
    assert lapsed.args == (setup.key(actor, "queue", 1), first.message_id)


def test_a_failed_publish_gives_its_lock_back(setup, log_lines):
    class BrokerDown(MiddlewareError):
        pass

    class Outage(dramatiq.Middleware):
        def before_enqueue(self, broker, message, delay):
            raise BrokerDown("publish failed")

    def sync(account_id):
        pass

    actor = setup.actor(sync, lock="until_executed")
    setup.broker.add_middleware(Outage())
    message = actor.message(1)
    with pytest.raises(BrokerDown):
        setup.broker.enqueue(message)
    assert setup.recorder.story() == [("locked", message.message_id), ("released", message.message_id)]
    assert len(logged(log_lines, "INFO", "Released %r: its message was not enqueued.")) == 1


# Run locks ------------------------------------------------------------------


def test_a_run_lock_is_locked_rescheduled_then_handed_over(setup, log_lines):
    # Given two sends for one key of a while_executing actor
    def sync(account_id):
        time.sleep(0.3)

    actor = setup.actor(sync, lock="while_executing", reschedule_delay=100)
    ids = {actor.send(1).message_id, actor.send(1).message_id}
    # When both run
    setup.start()
    wait_for(lambda: setup.unique.events.count("released") == 2, what="both runs")
    setup.drain()
    # Then one held the lock while the other was rescheduled, and it was handed over
    story = setup.recorder.story(":run")
    first = setup.recorder.named("locked")[0].message_id
    [second] = ids - {first}
    handover = story.index(("released", first))
    assert set(story[:handover]) == {("locked", first), ("rescheduled", second)}
    # the delayed copy, when it comes after the handed-over one, is skipped
    ran = [entry for entry in story[handover:] if entry != ("skipped", second)]
    assert ran == [("released", first), ("locked", second), ("released", second)]
    assert len(story[handover:]) - len(ran) <= 1
    assert logged(log_lines, "DEBUG", "Rescheduled %s: run lock %r is held.")


@pytest.mark.parametrize("strategy, line", [
    ("log", "Dropping %s: run lock %r is held by message %s."),
    ("reject", "Dead-lettering %s: run lock %r is held by message %s."),
])
def test_a_conflict_names_its_holder(setup, log_lines, strategy, line):
    # Given a while_executing actor that drops or dead-letters conflicts
    started = threading.Event()

    def sync(account_id):
        started.set()
        time.sleep(0.4)

    actor = setup.actor(sync, lock="while_executing", on_conflict=strategy)
    holder = actor.send(1)
    setup.start()
    assert started.wait(10)
    # When a second delivery meets the held key
    loser = actor.send(1)
    wait_for(lambda: setup.recorder.named("conflict"), what="the conflict")
    setup.drain()
    # Then the conflict event and the WARNING name both messages
    [conflict] = setup.recorder.named("conflict")
    assert (conflict.message_id, conflict.holder) == (loser.message_id, holder.message_id)
    [record] = logged(log_lines, "WARNING", line)
    assert record.args[2] == holder.message_id


def test_a_lost_lease_is_reported_once(stub_broker, log_lines):
    # Given a running actor with a 300 ms lease
    recorder = Recorder()
    middleware = unique(listeners=[recorder], lease=300)
    stub_broker.add_middleware(middleware)
    release = threading.Event()

    def sync(account_id):
        release.wait(10)

    setup = Setup(stub_broker, middleware, recorder)
    actor = setup.actor(sync, lock="while_executing")
    message = actor.send(1)
    setup.start()
    wait_for(lambda: recorder.named("locked"), what="the run lock")
    # When an operator deletes its lock while it runs
    assert middleware.backend.delete(setup.key(actor, "run", 1))
    wait_for(lambda: recorder.named("lock_lost"), what="the renewal to notice")
    release.set()
    setup.drain()
    # Then the loss is reported once, at ERROR, and never as a release
    assert recorder.story(":run") == [("locked", message.message_id), ("lock_lost", message.message_id)]
    [lost] = logged(log_lines, "ERROR",
                    "Lock %r was lost: message %s no longer holds it (its lease expired or it was taken over).")
    assert lost.args == (setup.key(actor, "run", 1), message.message_id)


# Backend failures -------------------------------------------------------------


def test_an_unreachable_backend_is_an_event_and_an_error_line(setup, log_lines):
    setup.unique.backend = RedisBackend(url=f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=0.2)

    def sync(account_id):
        pass

    actor = setup.actor(sync, lock="until_executed")
    message = actor.message(1)
    with pytest.raises(LockBackendError):
        setup.broker.enqueue(message)
    [event] = setup.recorder.events
    assert (event.name, event.message_id, event.actor) == ("backend_error", message.message_id, actor.actor_name)
    [line] = logged(log_lines, "ERROR", "Lock backend %s failed to %s %r: %r")
    assert line.args[1:3] == ("take the enqueue lock", event.key)


def test_a_backend_that_dies_mid_run_fails_renewals_then_loses_the_lease(stub_broker, log_lines):
    # Given locks in a private redis-server and a running actor with a 600 ms lease
    port = free_port()
    server = start_redis_server(port)
    try:
        recorder = Recorder()
        middleware = unique(RedisBackend(url=f"redis://127.0.0.1:{port}/0", socket_connect_timeout=0.2,
                                         socket_timeout=0.2), listeners=[recorder], lease=600)
        stub_broker.add_middleware(middleware)
        release = threading.Event()

        def sync(account_id):
            release.wait(10)

        setup = Setup(stub_broker, middleware, recorder)
        actor = setup.actor(sync, lock="while_executing", max_retries=0)
        message = actor.send(1)
        setup.start()
        wait_for(lambda: recorder.named("locked"), what="the run lock")
        # When the backend goes away
        server.terminate()
        server.wait()
        wait_for(lambda: recorder.named("lock_lost"), timeout=5, what="the lease to run out")
        release.set()
        setup.drain()
    finally:
        server.kill()
        server.wait()
    # Then each failed renewal was a backend_error, the lease was lost once, and the release failed too
    story = recorder.story(":run")
    assert story[0] == ("locked", message.message_id)
    assert story[1:] == [("backend_error", message.message_id), ("lock_lost", message.message_id),
                         ("backend_error", message.message_id)]
    assert len(recorder.named("backend_error")) >= 2
    assert logged(log_lines, "WARNING", "Could not renew %d lease(s): %r. Trying again.")
    assert logged(log_lines, "ERROR",
                  "Lock %r was lost: message %s no longer holds it (its lease expired or it was taken over).")
    [failed_release] = logged(log_lines, "ERROR", "Lock backend %s failed to %s %r: %r")
    assert failed_release.args[1] == "release"


# Subscribing ------------------------------------------------------------------


def test_listeners_subscribe_unsubscribe_and_never_break_locking(stub_broker, log_lines):
    # Given a listener given to the constructor that fails, and one subscribed later
    def broken(event):
        raise RuntimeError("listener bug")

    middleware = UniqueMiddleware(listeners=[broken])
    stub_broker.add_middleware(middleware)
    seen = []
    subscribed = middleware.events.subscribe(seen.append)

    def sync(account_id):
        pass

    actor = dramatiq.actor(sync, broker=stub_broker, actor_name=f"sync_{uuid.uuid4().hex[:6]}", lock="until_executed")
    first = actor.send(1)
    # Then locking works despite the failing listener, which is logged
    assert actor.send(1).options["unique_duplicate_of"] == first.message_id
    assert [e.name for e in seen] == ["locked", "duplicate"]
    assert len(logged(log_lines, "ERROR", "Lock event listener %r failed on %r.")) == 2
    # And an unsubscribed listener hears nothing more
    middleware.events.unsubscribe(subscribed)
    actor.send(2)
    assert [e.name for e in seen] == ["locked", "duplicate"]
    assert middleware.events.count("locked") == 2


def test_events_are_counted_without_a_listener_and_told_whole_to_one_subscribed_later(stub_broker):
    # Given a middleware with no listener (it builds no event then), and a duplicate send
    middleware = UniqueMiddleware()
    stub_broker.add_middleware(middleware)

    def sync(account_id):
        pass

    actor = dramatiq.actor(sync, broker=stub_broker, actor_name=f"sync_{uuid.uuid4().hex[:6]}", lock="until_executed")
    first = actor.send(1)
    actor.send(1)
    # Then both events are counted
    assert (middleware.events.count("locked"), middleware.events.count("duplicate")) == (1, 1)
    # And a listener subscribed later hears the next ones whole: message, key and holder
    seen: list[LockEvent] = []
    middleware.events.subscribe(seen.append)
    duplicate = actor.send(1)
    [event] = seen
    key = middleware.key(middleware.specs[actor.actor_name], first.options["unique_digest"], "queue")
    assert event == LockEvent("duplicate", actor.actor_name, key, duplicate.message_id, first.message_id)
    assert middleware.events.count("duplicate") == 2


# The table itself ---------------------------------------------------------------


def _log_calls(path: Path) -> set[tuple[str, str]]:
    """(level, template) of every ``….logger.<level>("…", …)`` call."""
    levels = {"debug": "DEBUG", "info": "INFO", "warning": "WARNING", "error": "ERROR", "exception": "ERROR"}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in levels
                and "logger" in ast.unparse(node.func.value) and node.args and isinstance(node.args[0], ast.Constant)):
            found.add((levels[node.func.attr], node.args[0].value))
    return found


def test_log_lines_lists_every_runtime_log_call_and_nothing_else():
    in_source = set().union(*(_log_calls(PACKAGE / name) for name in RUNTIME_MODULES))
    documented = {(line.level, line.template) for line in LOG_LINES}
    assert in_source == documented
    assert all(line.meaning and line.logger.startswith("dramatiq_unique.") for line in LOG_LINES)
