"""The lifecycle of every lock type and conflict strategy, on the Stub
and the Redis broker with an in-process worker.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from dataclasses import dataclass, field

import dramatiq
import pytest
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import AsyncIO, MiddlewareError

from dramatiq_unique import DuplicateMessage, fence_token
from dramatiq_unique.errors import LockBackendError
from dramatiq_unique.testing import wait_for_releases
from tests.conftest import make_worker, unique, wait_for


@dataclass
class Runs:
    """Start and end times of every execution, per key."""

    mutex: threading.Lock = field(default_factory=threading.Lock)
    spans: list[tuple[object, float, float]] = field(default_factory=list)
    running: int = 0
    peak: int = 0

    def enter(self):
        with self.mutex:
            self.running += 1
            self.peak = max(self.peak, self.running)
        return time.monotonic()

    def leave(self, key, began):
        with self.mutex:
            self.running -= 1
            self.spans.append((key, began, time.monotonic()))

    def count(self, key=None):
        with self.mutex:
            return sum(1 for k, _, _ in self.spans if key is None or k == key)

    def overlapping(self, key):
        mine = sorted((s, e) for k, s, e in self.spans if k == key)
        return [(a, b) for a, b in zip(mine, mine[1:]) if b[0] < a[1]]


class Rig:
    def __init__(self, broker, middleware):
        self.broker, self.unique, self.runs = broker, middleware, Runs()
        self.worker = None

    def start(self, threads=8):
        self.worker = make_worker(self.broker, threads)
        return self.worker

    def drain(self, queue="default"):
        if isinstance(self.broker, StubBroker):
            self.broker.join(queue, fail_fast=False)
        else:
            self.broker.join(queue, timeout=30_000)
        self.worker.join()

    def held(self, actor, *args, phase="queue", **kwargs):
        spec = self.unique.specs[actor.actor_name]
        key = self.unique.key(spec, spec.digest(args, kwargs), phase)
        return self.unique.backend.inspect(key)

    def queued(self, queue="default"):
        if isinstance(self.broker, StubBroker):
            return self.broker.queues[queue].qsize()
        return self.broker.client.llen(f"{self.broker.namespace}:{queue}")

    def dead(self, queue="default"):
        if isinstance(self.broker, StubBroker):
            return len(self.broker.dead_letters_by_queue[queue])
        return self.broker.client.hlen(f"{self.broker.namespace}:{queue}.XQ.msgs")


@pytest.fixture
def rig(any_broker):
    broker = any_broker
    broker.add_middleware(AsyncIO())
    middleware = unique()
    broker.add_middleware(middleware)
    r = Rig(broker, middleware)
    yield r
    if r.worker is not None:
        r.worker.stop()


def sleeper(rig, seconds=0.05, fail_times=0, **options):
    failures = {}

    def sync(account_id, requested_at=None):
        began = rig.runs.enter()
        try:
            if failures.setdefault(account_id, 0) < fail_times:
                failures[account_id] += 1
                raise RuntimeError("provider down")
            time.sleep(seconds)
        finally:
            rig.runs.leave(account_id, began)

    options.setdefault("min_backoff", 50)
    options.setdefault("max_backoff", 100)
    return dramatiq.actor(sync, broker=rig.broker, actor_name=f"sync_{uuid.uuid4().hex[:6]}", **options)


# Enqueue locks ----------------------------------------------------------


def test_until_executing_refuses_duplicates_until_the_actor_starts(rig):
    # Given an until_executing actor whose body sends itself again
    resent = []

    def job(account_id):
        resent.append(actor.send(account_id).options.get("unique_duplicate_of"))

    actor = dramatiq.actor(job, broker=rig.broker, lock="until_executing", max_retries=0)
    # When the same key is sent twice before any worker runs
    first, second = actor.send(1), actor.send(1)
    # Then the second is refused and names the first
    assert second.options["unique_duplicate_of"] == first.message_id
    assert rig.queued() == 1
    # And inside the actor the lock is already free
    rig.start()
    wait_for(lambda: resent, what="the actor to run")
    assert resent[0] is None


def test_until_executed_holds_while_queued_and_running_then_releases(rig):
    actor = sleeper(rig, seconds=0.3, lock="until_executed")
    first = actor.send(7)
    assert actor.send(7).options["unique_duplicate_of"] == first.message_id
    rig.start()
    wait_for(lambda: rig.runs.running == 1, what="the run to start")
    assert actor.send(7).options["unique_duplicate_of"] == first.message_id
    rig.drain()
    assert rig.held(actor, 7) is None
    assert "unique_duplicate_of" not in actor.send(7).options


def test_until_executed_keeps_its_lock_while_a_retry_is_pending(rig):
    # Given an actor that fails once, with a long backoff
    actor = sleeper(rig, fail_times=1, lock="until_executed", min_backoff=600, max_backoff=600)
    first = actor.send(3)
    rig.start()
    wait_for(lambda: rig.runs.count() == 1, what="the first failure")
    # Then a duplicate is refused while the retry waits
    assert actor.send(3).options["unique_duplicate_of"] == first.message_id
    rig.drain()
    assert rig.runs.count() == 2
    assert rig.held(actor, 3) is None


def test_the_final_failure_releases_until_executed(rig):
    actor = sleeper(rig, fail_times=5, lock="until_executed", max_retries=1)
    actor.send(4)
    rig.start()
    wait_for(lambda: rig.dead() == 1, what="the message to be dead-lettered")
    wait_for(lambda: rig.held(actor, 4) is None, what="the lock to be released")
    assert rig.runs.count() == 2


def test_until_expired_outlives_the_run(rig):
    actor = sleeper(rig, lock="until_expired", lock_ttl=600)
    actor.send(5)
    rig.start()
    rig.drain()
    assert rig.runs.count() == 1
    assert actor.send(5).options.get("unique_duplicate_of")
    wait_for(lambda: rig.held(actor, 5) is None, timeout=3, what="the lock to expire")
    assert "unique_duplicate_of" not in actor.send(5).options


def test_a_delayed_message_keeps_its_lock_through_promotion(rig):
    # Given a delayed until_executed message whose ttl is shorter than its delay
    actor = sleeper(rig, lock="until_executed", lock_ttl=300)
    first = actor.send_with_options(args=(6,), delay=600)
    rig.start()
    time.sleep(0.45)  # past the ttl alone, not past delay + ttl: this is the behaviour under test
    # Then the lock still counts from when the message is due
    assert actor.send(6).options["unique_duplicate_of"] == first.message_id
    wait_for(lambda: rig.runs.count() == 1, what="the delayed run")
    rig.drain()
    assert rig.held(actor, 6) is None and rig.runs.count() == 1


def test_an_age_limit_skip_releases_the_lock(rig):
    actor = sleeper(rig, lock="until_executed", max_age=1)
    actor.send(8)
    time.sleep(0.01)
    rig.start()
    wait_for(lambda: rig.dead() == 1, what="AgeLimit to dead-letter the message")
    wait_for(lambda: rig.held(actor, 8) is None, what="the lock to be released")
    assert rig.runs.count() == 0


def test_send_raise_refuses_with_the_holder(rig):
    actor = sleeper(rig, lock="until_executed", on_conflict="raise")
    first = actor.send(9)
    with pytest.raises(DuplicateMessage) as info:
        actor.send(9)
    assert info.value.holder == first.message_id and "{" in info.value.key
    assert rig.queued() == 1


def test_every_way_of_enqueueing_is_deduplicated(rig):
    actor = sleeper(rig, lock="until_executed")
    actor.send(10)
    actor.send_with_options(args=(10,), max_retries=0)
    rig.broker.enqueue(actor.message(10))
    dramatiq.pipeline([actor.message(10), actor.message(11)]).run()
    dramatiq.group([actor.message(10), actor.message(12)]).run()
    assert rig.queued() == 2  # 10 once, 12 once; 11 waits in the pipeline
    rig.start()
    rig.drain()
    assert sorted(k for k, _, _ in rig.runs.spans) == [10, 12]


def test_lock_args_bind_by_name_and_position(rig):
    actor = sleeper(rig, lock="until_executed", lock_args=["account_id"])
    first = actor.send(42, 1.0)
    assert actor.send(account_id=42, requested_at=2.0).options["unique_duplicate_of"] == first.message_id
    assert "unique_duplicate_of" not in actor.send(43, 1.0).options


def test_lock_args_method(rig):
    actor = sleeper(rig, lock="until_executed",
                    lock_args_method=lambda account_id, requested_at=None: [account_id % 10])
    first = actor.send(12, 1.0)
    assert actor.send(22, 2.0).options["unique_duplicate_of"] == first.message_id


def test_unsendable_lock_args_fail_at_send_and_enqueue_nothing(rig):
    from dramatiq_unique import ConfigurationError

    actor = sleeper(rig, lock="until_executed")
    with pytest.raises(ConfigurationError, match="JSON"):
        actor.send(object())
    with pytest.raises(ConfigurationError, match="do not match"):
        actor.send(1, 2, 3)
    assert rig.queued() == 0 and list(rig.unique.backend.scan("*")) == []


def test_a_failed_publish_releases_the_lock(rig):
    class BrokerDown(MiddlewareError):
        pass

    class Outage(dramatiq.Middleware):
        def before_enqueue(self, broker, message, delay):
            raise BrokerDown("publish failed")

    actor = sleeper(rig, lock="until_executed")
    rig.broker.add_middleware(Outage())
    with pytest.raises(BrokerDown):
        actor.send(13)
    assert rig.held(actor, 13) is None


# Run locks ------------------------------------------------------------------


def test_while_executing_serializes_one_key_and_runs_others_alongside(rig):
    actor = sleeper(rig, seconds=0.2, lock="while_executing", reschedule_delay=100)
    for account in (1, 1, 1, 2, 3):
        actor.send(account)
    rig.start()
    wait_for(lambda: rig.runs.count() == 5, what="all five runs")
    rig.drain()
    assert rig.runs.overlapping(1) == []
    assert rig.runs.count(1) == 3 and rig.runs.count(2) == 1
    first = min(s for k, s, _ in rig.runs.spans if k == 1)
    assert all(s < first + 0.2 for k, s, _ in rig.runs.spans if k in (2, 3))


def test_lock_limit_runs_three_at_once_and_never_four(rig):
    actor = sleeper(rig, seconds=0.15, lock="while_executing", lock_limit=3, reschedule_delay=50)
    for _ in range(9):
        actor.send(1)
    rig.start(threads=8)
    wait_for(lambda: rig.runs.count() == 9, timeout=20, what="nine runs")
    assert rig.runs.peak == 3


def test_until_and_while_executing_queues_once_and_runs_serialized(rig):
    actor = sleeper(rig, seconds=0.3, lock="until_and_while_executing", reschedule_delay=100)
    first = actor.send(1)
    assert actor.send(1).options["unique_duplicate_of"] == first.message_id
    rig.start()
    wait_for(lambda: rig.runs.running == 1, what="the first run")
    # the enqueue lock was handed over at start: one more may queue, and it waits
    second = actor.send(1)
    assert "unique_duplicate_of" not in second.options
    assert actor.send(1).options["unique_duplicate_of"] == second.message_id
    wait_for(lambda: rig.runs.count() == 2, what="both runs")
    assert rig.runs.overlapping(1) == []


@pytest.mark.parametrize("strategy", ["log", "reject", "raise"])
def test_server_strategies(rig, strategy):
    actor = sleeper(rig, seconds=0.4, lock="while_executing", on_conflict=strategy, max_retries=3, min_backoff=500,
                    max_backoff=500)
    actor.send(1)
    rig.start()
    wait_for(lambda: rig.runs.running == 1, what="the first run")
    actor.send(1)
    if strategy == "raise":
        # a failure that goes through Retries, so both run in the end
        wait_for(lambda: rig.runs.count() == 2, timeout=10, what="the retried run")
        assert rig.runs.overlapping(1) == []
        return
    rig.drain()
    assert rig.runs.count() == 1
    assert rig.dead() == (1 if strategy == "reject" else 0)
    assert rig.unique.events.count("conflict") == 1


def test_a_time_limit_interruption_releases_the_run_lock(rig):
    def stuck(account_id):
        for _ in range(200):
            time.sleep(0.01)

    actor = dramatiq.actor(stuck, broker=rig.broker, lock="while_executing", time_limit=200, max_retries=0)
    actor.send(1)
    rig.start()
    wait_for(lambda: rig.dead() == 1, what="the interrupted message to be dead-lettered")
    wait_for_releases(rig.unique)  # the run lock is released in the background, a moment after
    assert rig.held(actor, 1, phase="run") is None
    assert rig.unique.events.count("lock_lost") == 0
    assert rig.unique.events.count("released") == 1


def test_an_async_actor_holds_its_lock_and_sees_its_fence(rig):
    fences = []

    async def fetch(account_id):
        fences.append(fence_token())

    actor = dramatiq.actor(fetch, broker=rig.broker, lock="while_executing")
    actor.send(1)
    actor.send(1)
    rig.start()
    wait_for(lambda: len(fences) == 2, what="both async runs")
    assert all(isinstance(f, int) for f in fences) and fences[0] != fences[1]


def test_the_middleware_moves_before_age_limit_and_time_limit(rig):
    # A locked actor: with none, boot leaves the stack alone (tests/test_quiet_unused.py)
    sleeper(rig, lock="while_executing")
    rig.start()
    names = [type(m).__name__ for m in rig.broker.middleware]
    assert names.index("UniqueMiddleware") < names.index("AgeLimit") < names.index("TimeLimit")
    # Only Dramatiq's Prometheus (first by default in 1.x) may come before it.
    assert set(names[: names.index("UniqueMiddleware")]) <= {"Prometheus"}


def test_disabled_means_no_locking(rig):
    rig.unique.enabled = False
    actor = sleeper(rig, lock="until_executed")
    actor.send(1)
    assert "unique_duplicate_of" not in actor.send(1).options
    assert rig.queued() == 2


# Failing closed -----------------------------------------------------------


def test_a_backend_outage_never_runs_a_locked_actor(rig):
    from tests.conftest import free_port

    from dramatiq_unique.backends.redis import RedisBackend

    # Given locks in a Redis that does not answer
    rig.unique.backend = RedisBackend(url=f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=0.2)
    # A failed take may have applied: the stopping worker owes its releases
    # and would try to send them for most of the default 10 s.
    rig.unique.settings = dataclasses.replace(rig.unique.settings, shutdown_timeout=1000)
    runner = sleeper(rig, lock="while_executing", max_retries=2, min_backoff=50)
    sender = sleeper(rig, lock="until_executed")
    # Then a send with an enqueue lock fails, naming the backend, and enqueues nothing
    with pytest.raises(LockBackendError, match="Lock backend RedisBackend"):
        sender.send(1)
    assert rig.queued() == 0
    # And a run lock that cannot be taken fails the delivery instead of running it
    runner.send(1)
    rig.start()
    wait_for(lambda: rig.dead() == 1, what="the retries to be exhausted")
    assert rig.runs.count() == 0
    assert rig.unique.events.count("backend_error") >= 3


def test_a_delay_queue_move_never_raises_even_for_a_message_it_cannot_key(rig):
    # Given a delayed message sent unlocked (so unstamped) whose args give no key
    actor = sleeper(rig, lock="until_executed", max_retries=0)
    rig.unique.enabled = False
    actor.send_with_options(args=("caf\udce9",), delay=100)
    rig.unique.enabled = True
    # When the worker moves it out of the delay queue
    rig.start()
    # Then the move goes on (raising there would strand it), and the delivery,
    # which cannot take its lock, fails through Retries instead of running unlocked
    wait_for(lambda: rig.dead() == 1, what="the unkeyable message to be dead-lettered")
    assert rig.runs.count() == 0


def test_an_async_actor_that_ignores_its_time_limit_keeps_its_lock_until_it_ends(rig):
    # Given an async actor whose coroutine ignores cancellation and runs on past its time limit
    import asyncio

    spans = []

    async def stubborn(account_id):
        began = time.monotonic()
        try:
            await asyncio.sleep(0.1 if spans else 5)
        except asyncio.CancelledError:
            await asyncio.sleep(1.5)  # ignores the cancellation, and goes on
        spans.append((began, time.monotonic()))

    actor = dramatiq.actor(stubborn, broker=rig.broker, lock="while_executing", time_limit=300, max_retries=0)
    actor.send(1)
    rig.start()
    wait_for(lambda: rig.held(actor, 1, phase="run") is not None, what="the first run")
    actor.send(1)
    # When the worker thread gives up on it and runs the after-hooks
    wait_for(lambda: len(spans) == 2, timeout=15, what="both runs")
    # Then the second run started only after the first coroutine really ended
    (first_start, first_end), (second_start, _) = sorted(spans)
    assert second_start >= first_end
    assert rig.unique.events.count("lock_lost") == 0


def test_placement_at_boot_runs_every_boot_hook_once(stub_broker):
    # Given AsyncIO, then the middleware, then Prometheus: boot moves both of ours
    import dramatiq.asyncio
    from dramatiq.middleware.prometheus import Prometheus

    stub_broker.add_middleware(AsyncIO())
    stub_broker.add_middleware(unique())
    stub_broker.add_middleware(Prometheus())
    dramatiq.actor(lambda key: None, broker=stub_broker, actor_name="placed", lock="while_executing")
    worker = make_worker(stub_broker, threads=1)
    try:
        # Then AsyncIO started one event loop, not one per visit of its boot hook
        loops = [t for t in threading.enumerate() if isinstance(t, dramatiq.asyncio.EventLoopThread)]
        assert len(loops) == 1
        names = [type(m).__name__ for m in stub_broker.middleware]
        assert names.index("Prometheus") < names.index("UniqueMiddleware") < names.index("AgeLimit")
    finally:
        worker.stop()
