"""``on_conflict="replace"`` and ``debounce``: the backend contract of
``replace``/``current`` (Stub and Redis; ``tests/test_cluster.py``
borrows it for the Cluster), the declaration rules, and the behaviour
per lock type with a real worker on the StubBroker.

The real-worker runs on the Redis broker and RabbitMQ are in
``tests/test_newest_wins.py``.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any, Iterator

import dramatiq
import pytest
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import MiddlewareError
from dramatiq.results import ResultFailure, Results
from dramatiq.results.backends import StubBackend as ResultsStub

from dramatiq_unique import ConfigurationError, LockBackend, StubBackend, UniqueMiddleware
from dramatiq_unique.backends.records import CurrentCheck, CurrentStatus, ReplaceStatus
from tests.conftest import make_worker, wait_for

LOCK_TTL = 60_000


def lock_key() -> str:
    return f"test:actor:{{{uuid.uuid4().hex}}}:queue"


def replace(backend: LockBackend, key: str, owner: str, **options: Any) -> Any:
    options.setdefault("ttl", LOCK_TTL)
    options.setdefault("superseded_ttl", LOCK_TTL)
    options.setdefault("lock", "until_executed")
    return backend.replace(key, owner, **options)


def reenter(backend: LockBackend, key: str, owner: str) -> CurrentCheck:
    """``current`` as a re-enqueue of ``owner`` asks it."""
    return backend.current(key, owner, reenter=True, ttl=LOCK_TTL, lock="until_executed")


# The backend contract ----------------------------------------------------------


def test_replace_takes_a_free_key_and_supersedes_a_waiting_holder(backend: LockBackend) -> None:
    key = lock_key()
    assert replace(backend, key, "a").status is ReplaceStatus.ACQUIRED
    got = replace(backend, key, "b")
    assert (got.status, got.holder) == (ReplaceStatus.REPLACED, "a")
    info = backend.inspect(key)
    assert info is not None and set(info.holders) == {"b"} and (info.current, info.superseded) == ("b", 1)
    assert backend.current(key, "a") == CurrentCheck(CurrentStatus.SUPERSEDED, "b")
    assert backend.current(key, "b") == CurrentCheck(CurrentStatus.CURRENT, None)
    # a publish retry of the same send re-enters
    assert replace(backend, key, "b").status is ReplaceStatus.REENTERED


def test_a_started_holder_keeps_its_slot_and_gives_it_up_on_its_next_delivery(backend: LockBackend) -> None:
    key = lock_key()
    replace(backend, key, "a")
    assert backend.current(key, "a") == CurrentCheck(CurrentStatus.CURRENT, None)  # delivered: started
    assert replace(backend, key, "b").holder == "a"
    info = backend.inspect(key)
    assert info is not None and set(info.holders) == {"a", "b"} and info.current == "b"
    # its retry is superseded too, and takes its own slot with it
    assert backend.current(key, "a") == CurrentCheck(CurrentStatus.SUPERSEDED, "b")
    info = backend.inspect(key)
    assert info is not None and set(info.holders) == {"b"}
    # the superseded message's release never touches the new holder's slot
    assert not backend.release(key, "a").held
    assert backend.release(key, "b").held
    assert backend.inspect(key) is None


def test_a_send_after_the_current_message_finished_leaves_a_running_superseded_one_alone(
    backend: LockBackend,
) -> None:
    key = lock_key()
    replace(backend, key, "a")
    backend.current(key, "a")  # a runs
    replace(backend, key, "b")  # supersedes a, which keeps its slot
    backend.current(key, "b")
    assert backend.release(key, "b").held  # b ran and finished first
    got = replace(backend, key, "c")
    assert (got.status, got.holder) == (ReplaceStatus.ACQUIRED, None)  # a was superseded already
    assert backend.release(key, "a").held  # a finishes: its slot was never taken from it
    info = backend.inspect(key)
    assert info is not None and set(info.holders) == {"c"} and info.current == "c"


def test_keep_started_refuses_a_send_once_the_holder_started(backend: LockBackend) -> None:
    key = lock_key()
    replace(backend, key, "a", keep_started=True)
    assert replace(backend, key, "b", keep_started=True).status is ReplaceStatus.REPLACED
    backend.current(key, "b")
    got = replace(backend, key, "c", keep_started=True)
    assert (got.status, got.holder) == (ReplaceStatus.REFUSED, "b")
    assert backend.current(key, "c") == CurrentCheck(CurrentStatus.CURRENT)  # refused, so never superseded anyone


def test_a_superseded_message_never_re_enters_or_retakes_the_key(backend: LockBackend) -> None:
    key = lock_key()
    replace(backend, key, "a")
    replace(backend, key, "b")
    assert reenter(backend, key, "b") == CurrentCheck(CurrentStatus.REENTERED, "b")
    assert reenter(backend, key, "a") == CurrentCheck(CurrentStatus.SUPERSEDED, "b")
    backend.release(key, "b")
    assert reenter(backend, key, "a") == CurrentCheck(CurrentStatus.SUPERSEDED, "b")
    assert backend.inspect(key) is None
    # a current message whose lock lapsed takes the free key again
    assert reenter(backend, key, "c") == CurrentCheck(CurrentStatus.CURRENT, "c")
    info = backend.inspect(key)
    assert info is not None and info.current == "c"


def test_debounce_delays_each_send_and_caps_the_burst(backend: LockBackend) -> None:
    key = lock_key()
    first = replace(backend, key, "a", debounce=1000, debounce_max=1100)
    assert first.delay == 1000
    time.sleep(0.3)  # the behaviour under test: how far into the burst the next send comes
    second = replace(backend, key, "b", debounce=1000, debounce_max=1100)
    assert second.status is ReplaceStatus.REPLACED and 700 <= second.delay <= 810
    # once the current message started, the next send opens a new burst
    backend.current(key, "b")
    third = replace(backend, key, "c", debounce=1000, debounce_max=1100)
    assert third.status is ReplaceStatus.REPLACED and third.delay == 1000


def test_unreplace_makes_the_superseded_message_current_again(backend: LockBackend) -> None:
    key = lock_key()
    replace(backend, key, "a")
    replace(backend, key, "b")
    assert backend.unreplace(key, "a") is None  # not current
    assert backend.unreplace(key, "b") == "a"
    assert backend.unreplace(key, "b") is None  # once
    backend.release(key, "b")
    info = backend.inspect(key)
    assert info is not None and set(info.holders) == {"a"} and (info.current, info.superseded) == ("a", 0)
    assert backend.current(key, "a") == CurrentCheck(CurrentStatus.CURRENT, None)


def test_the_superseded_record_expires(backend: LockBackend) -> None:
    key = lock_key()
    replace(backend, key, "a", superseded_ttl=200)
    replace(backend, key, "b", superseded_ttl=200)
    assert backend.current(key, "a") == CurrentCheck(CurrentStatus.SUPERSEDED, "b")
    time.sleep(0.3)  # the behaviour under test: expiry
    assert backend.current(key, "a") == CurrentCheck(CurrentStatus.CURRENT, None)


# Declaration -------------------------------------------------------------------


@pytest.fixture
def broker(stub_broker: StubBroker) -> StubBroker:
    stub_broker.add_middleware(UniqueMiddleware(backend=StubBackend()))
    return stub_broker


def declare(broker: StubBroker, **options: Any) -> Any:
    def sync(account_id: int, n: int = 0) -> None:
        pass

    return dramatiq.actor(sync, broker=broker, actor_name="sync", **options)


@pytest.mark.parametrize(
    "options, says",
    [
        ({"lock": "while_executing", "on_conflict": "replace"}, "needs a lock type with an enqueue lock"),
        ({"lock": "until_executed", "on_conflict": "replace", "lock_limit": 2}, "lock_limit must be 1"),
        ({"lock": "while_executing", "debounce": 500}, "debounce needs a lock type with an enqueue lock"),
        ({"debounce": 500, "on_conflict": "log"}, "debounce works by replacing"),
        ({"lock": "until_and_while_executing", "debounce": 500, "on_conflict": {"client": "raise"}},
         "debounce works by replacing"),
        ({"debounce": 0}, "positive whole number of milliseconds"),
        ({"debounce": 1.5}, "positive whole number of milliseconds"),
        ({"debounce": 500, "debounce_max": 100}, "shorter than debounce"),
        ({"lock": "until_executed", "debounce_max": 100}, "only applies with debounce"),
        ({"debounce_max": 100}, "but no lock="),
    ],
)
def test_invalid_replace_options_fail_at_declaration_naming_the_actor(
    broker: StubBroker, options: dict[str, Any], says: str
) -> None:
    with pytest.raises(ConfigurationError) as info:
        declare(broker, **options)
    assert says in str(info.value) and str(info.value).startswith("Actor 'sync': ")
    assert "sync" not in broker.actors


def test_debounce_alone_implies_until_executing_and_replace(broker: StubBroker) -> None:
    declare(broker, debounce=500, debounce_max=2000)
    spec = broker.middleware[-1].specs["sync"]
    assert (spec.lock.name, spec.client, spec.debounce, spec.debounce_max) == ("until_executing", "replace", 500, 2000)


def test_replace_on_a_lock_with_both_sides_keeps_the_server_default(broker: StubBroker) -> None:
    declare(broker, lock="until_and_while_executing", on_conflict="replace")
    spec = broker.middleware[-1].specs["sync"]
    assert (spec.client, spec.server) == ("replace", "reschedule")


# Behaviour with a worker on the StubBroker -------------------------------------------


class Rig:
    def __init__(self, broker: StubBroker, middleware: UniqueMiddleware) -> None:
        self.broker = broker
        self.middleware = middleware
        self.mutex = threading.Lock()
        self.runs: list[tuple[str, int, float, float]] = []
        self.started: list[int] = []
        self.worker: Any = None

    def record(self, actor: str, n: int, seconds: float) -> None:
        start = time.monotonic()
        with self.mutex:
            self.started.append(n)
        time.sleep(seconds)
        with self.mutex:
            self.runs.append((actor, n, start, time.monotonic()))

    def ran(self, actor: str) -> list[int]:
        with self.mutex:
            return [n for name, n, _, _ in self.runs if name == actor]

    def start(self) -> None:
        self.worker = make_worker(self.broker)

    def idle(self, queue: str = "default") -> None:
        self.broker.join(queue, fail_fast=False)
        self.worker.join()


@pytest.fixture
def rig(stub_broker: StubBroker, caplog: pytest.LogCaptureFixture) -> Iterator[Rig]:
    caplog.set_level(logging.DEBUG, logger="dramatiq_unique")
    stub_broker.add_middleware(Results(backend=ResultsStub()))
    middleware = UniqueMiddleware(backend=StubBackend(), reschedule_delay=100)
    stub_broker.add_middleware(middleware)
    r = Rig(stub_broker, middleware)
    yield r
    if r.worker is not None:
        r.worker.stop()


def unwanted(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Log lines from this package above INFO: a replace must cause none."""
    return [r.getMessage() for r in caplog.records if r.name.startswith("dramatiq_unique") and r.levelno > logging.INFO]


def test_a_superseded_message_does_not_run_and_its_caller_learns_why(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    @dramatiq.actor(lock="until_executed", on_conflict="replace", lock_args=["doc"], store_results=True)
    def reindex(doc: int, n: int) -> int:
        rig.record("reindex", n, 0)
        return n

    old = reindex.send(1, 1)
    new = reindex.send(1, 2)
    assert new.options["unique_replaced"] == old.message_id
    rig.start()
    rig.idle()
    assert rig.ran("reindex") == [2]
    assert new.get_result(block=True, timeout=1000) == 2
    with pytest.raises(ResultFailure) as failure:
        old.get_result(block=True, timeout=1000)
    assert f"superseded by message {new.message_id}" in str(failure.value)
    assert rig.middleware.events.count("superseded") == 1
    assert f"Skipped {old}: message {new.message_id} superseded it" in caplog.text
    assert unwanted(caplog) == []
    assert list(rig.middleware.backend.scan("*")) == []  # type: ignore[union-attr]


def test_until_executed_a_send_during_a_run_is_enqueued_and_runs_too(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    @dramatiq.actor(lock="until_executed", on_conflict="replace", lock_args=["doc"])
    def reindex(doc: int, n: int) -> None:
        rig.record("reindex", n, 0.3)

    rig.start()
    reindex.send(1, 1)
    wait_for(lambda: rig.started == [1], what="the first run")
    second = reindex.send(1, 2)
    assert "unique_replaced" in second.options
    rig.idle()
    assert sorted(rig.ran("reindex")) == [1, 2]
    assert rig.middleware.events.count("lock_lost") == 0 and unwanted(caplog) == []
    assert list(rig.middleware.backend.scan("*")) == []  # type: ignore[union-attr]


def test_until_and_while_executing_a_send_during_a_run_waits_for_the_run_lock(rig: Rig) -> None:
    @dramatiq.actor(lock="until_and_while_executing", on_conflict="replace", lock_args=["doc"])
    def reindex(doc: int, n: int) -> None:
        rig.record("reindex", n, 0.3)

    rig.start()
    reindex.send(1, 1)
    wait_for(lambda: rig.started == [1], what="the first run")
    reindex.send(1, 2)
    reindex.send(1, 3)
    rig.idle()
    time.sleep(0.3)  # a rescheduled copy of the superseded message must not run: the behaviour under test
    rig.idle()
    assert rig.ran("reindex") == [1, 3]
    spans = sorted((start, end) for _, _, start, end in rig.runs)
    assert spans[1][0] >= spans[0][1]


def test_until_expired_refuses_a_send_once_the_holder_started(rig: Rig) -> None:
    @dramatiq.actor(lock="until_expired", on_conflict="replace", lock_args=["doc"], lock_ttl=60_000)
    def reindex(doc: int, n: int) -> None:
        rig.record("reindex", n, 0)

    reindex.send(1, 1)
    second = reindex.send(1, 2)
    rig.start()
    rig.idle()
    third = reindex.send(1, 3)
    assert third.options["unique_duplicate_of"] == second.message_id
    rig.idle()
    assert rig.ran("reindex") == [2]


def test_a_superseded_message_waiting_for_its_retry_never_runs_again(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    @dramatiq.actor(lock="until_executed", on_conflict="replace", lock_args=["doc"], max_retries=3,
                    min_backoff=200, max_backoff=200)
    def flaky(doc: int, n: int, fail: bool) -> None:
        rig.record("flaky", n, 0)
        if fail:
            raise RuntimeError("fails")

    rig.start()
    old = flaky.send(1, 1, True)
    wait_for(lambda: rig.ran("flaky") == [1], what="the failing run")
    new = flaky.send(1, 2, False)
    assert new.options["unique_replaced"] == old.message_id
    rig.idle()
    time.sleep(0.5)  # past the retry's backoff: the retry must not run
    rig.idle()
    assert rig.ran("flaky") == [1, 2]
    assert rig.middleware.events.count("superseded") == 1
    assert rig.middleware.events.count("lock_lost") == 0 and unwanted(caplog) == []
    assert list(rig.middleware.backend.scan("*")) == []  # type: ignore[union-attr]


def test_a_failed_replacing_publish_leaves_the_superseded_message_to_run(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    class BrokerDown(MiddlewareError):
        pass

    class Outage(dramatiq.Middleware):
        down = False

        def before_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
            if self.down:
                raise BrokerDown("publish failed")

    outage = Outage()
    rig.broker.add_middleware(outage)

    @dramatiq.actor(lock="until_executed", on_conflict="replace", lock_args=["doc"])
    def reindex(doc: int, n: int) -> None:
        rig.record("reindex", n, 0)

    reindex.send(1, 1)
    outage.down = True
    with pytest.raises(BrokerDown):
        reindex.send(1, 2)
    outage.down = False
    assert "is current again" in caplog.text
    rig.start()
    rig.idle()
    assert rig.ran("reindex") == [1]
    assert list(rig.middleware.backend.scan("*")) == []  # type: ignore[union-attr]


def test_debounce_runs_the_last_send_of_a_burst_once_after_the_quiet_window(rig: Rig) -> None:
    @dramatiq.actor(debounce=200, lock_args=["doc"])
    def reindex(doc: int, n: int) -> None:
        rig.record("reindex", n, 0)

    rig.start()
    for n in range(20):
        reindex.send(1, n)
    last = time.monotonic()
    wait_for(lambda: rig.ran("reindex"), what="the run")
    rig.idle()
    time.sleep(0.1)
    assert rig.ran("reindex") == [19]
    assert rig.runs[0][2] >= last + 0.2
    assert rig.middleware.events.count("superseded") == 19
    assert list(rig.middleware.backend.scan("*")) == []  # type: ignore[union-attr]


# Operators -------------------------------------------------------------------------


def test_operators_see_the_current_message_and_how_many_it_superseded(
    stub_broker: StubBroker, redis_backend: Any, redis_url: str
) -> None:
    import json
    import subprocess
    import sys
    from wsgiref.util import setup_testing_defaults

    from dramatiq_unique import digest_for
    from dramatiq_unique.ops.admin import LockAdmin
    from dramatiq_unique.dashboard import make_app
    from tests.procs import ROOT

    prefix = f"ops-{uuid.uuid4().hex[:8]}"
    stub_broker.add_middleware(UniqueMiddleware(backend=redis_backend, prefix=prefix))

    @dramatiq.actor(broker=stub_broker, debounce=60_000, lock_args=["doc"])
    def reindex(doc: int, n: int) -> None:
        pass

    sent = [reindex.send(1, n) for n in range(3)]
    digest = digest_for(reindex, 1, 0)
    [lock] = LockAdmin(redis_backend, prefix=prefix).inspect(digest)
    assert (lock.current, lock.superseded) == (sent[-1].message_id, 2)

    shown = subprocess.run([sys.executable, "-m", "dramatiq_unique", "inspect", digest, "--redis", redis_url,
                            "--prefix", prefix], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert f"current    {sent[-1].message_id}  (superseded 2)" in shown.stdout, shown.stderr

    environ: dict[str, Any] = {"PATH_INFO": f"/api/locks/{digest}"}
    setup_testing_defaults(environ)
    body = b"".join(make_app(redis_backend, prefix=prefix)(environ, lambda status, headers: None))
    [seen] = json.loads(body)["locks"]
    assert (seen["current"], seen["superseded"]) == (sent[-1].message_id, 2)
