"""A rule set for ``on_conflict="replace"``, over the real middleware
hooks (``UniqueMiddleware`` with Dramatiq's own ``Retries`` and the rest
of the default stack, a ``StubBroker`` and a ``StubBackend``).

The machine plays the worker: it sends, delivers any copy of any
message in any order, lets deliveries succeed, fail (Retries re-enqueues
them on the delay queue) or crash (no after-hook at all: the copy is
redelivered later), and moves delayed copies back to their queue, as a
worker's consumer does.  It checks:

* a superseded message never starts after the send that superseded it;
* a message succeeds at most once, and once every copy is gone, the
  newest message has succeeded once (unless its retries ran out);
* while the newest message has not started, it is the key's current
  holder; and once every copy is gone, no lock is left.
"""

from __future__ import annotations

import uuid
from typing import Any, Optional

import dramatiq
import pytest
from dramatiq import Message
from dramatiq.broker import MessageProxy
from dramatiq.brokers.stub import StubBroker
from dramatiq.common import dq_name
from dramatiq.middleware import SkipMessage
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from dramatiq_unique import StubBackend, UniqueMiddleware, digest_for
from dramatiq_unique.backends.redis import RedisBackend
from dramatiq_unique.testing import wait_for_releases

QUEUE = "replace-machine"


class ReplaceMachine(RuleBasedStateMachine):
    lock = "until_executed"
    #: Whether no lock may ever be reported lost.  The types that give up
    #: their enqueue lock at the start see it taken by a new send while a
    #: retry waits, and say so, as without replace.
    never_lost = True
    #: Locks on this Redis instead of a StubBackend.
    redis_url: Optional[str] = None

    def __init__(self) -> None:
        super().__init__()
        self.broker = StubBroker()
        self.broker.emit_after("process_boot")
        self.prefix = f"machine-{uuid.uuid4().hex[:8]}"
        backend = RedisBackend(url=self.redis_url) if self.redis_url else StubBackend()
        self.middleware = UniqueMiddleware(backend=backend, prefix=self.prefix)
        self.broker.add_middleware(self.middleware)

        @dramatiq.actor(broker=self.broker, queue_name=QUEUE, lock=self.lock, on_conflict="replace",
                        lock_args=["doc"], max_retries=1, min_backoff=10, max_backoff=10)
        def reindex(doc: int, n: int) -> None:
            pass

        self.actor = reindex
        self.middleware.before_worker_boot(self.broker, None)  # type: ignore[arg-type]
        self.key = f"{self.middleware.settings.prefix}:reindex:{{{digest_for(reindex, 1, 0)}}}:queue"
        self.step = 0
        self.pool: list[Message[Any]] = []  # every copy a worker could still be handed
        self.superseded_at: dict[str, int] = {}
        self.successes: dict[str, int] = {}
        self.started: set[str] = set()
        self.exhausted: set[str] = set()
        self.newest: Optional[str] = None
        self.running: list[MessageProxy] = []

    def collect(self) -> None:
        for name in (QUEUE, dq_name(QUEUE)):
            queue = self.broker.queues[name]
            while not queue.empty():
                self.pool.append(Message.decode(queue.get_nowait()))
                queue.task_done()

    # Rules ----------------------------------------------------------------------

    @rule(n=st.integers(0, 1000))
    def send(self, n: int) -> None:
        self.step += 1
        message = self.actor.send(1, n)
        replaced = message.options.get("unique_replaced")
        if replaced is not None:
            self.superseded_at.setdefault(replaced, self.step)
        self.newest = message.message_id
        self.collect()

    @precondition(lambda self: any(m.queue_name == dq_name(QUEUE) for m in self.pool))
    @rule(data=st.data())
    def move_from_delay_queue(self, data: st.DataObject) -> None:
        delayed = [m for m in self.pool if m.queue_name == dq_name(QUEUE)]
        message = data.draw(st.sampled_from(delayed))
        self.pool.remove(message)
        moved = message.copy(queue_name=QUEUE)
        del moved.options["eta"]
        self.broker.enqueue(moved)
        self.collect()

    @precondition(lambda self: any(m.queue_name == QUEUE for m in self.pool))
    @rule(data=st.data(), outcome=st.sampled_from(["success", "failure", "crash", "hold"]))
    def deliver(self, data: st.DataObject, outcome: str) -> None:
        ready = [m for m in self.pool if m.queue_name == QUEUE]
        message = data.draw(st.sampled_from(ready))
        if outcome == "crash" and self.lock == "until_and_while_executing":
            outcome = "hold"  # a crashed holder's lease runs out only when its process is gone
        self.pool.remove(message)
        proxy = MessageProxy(message)
        if not self.begin(proxy):
            return
        if outcome == "crash":
            self.pool.append(message)  # no hook, no ack: the broker hands the same copy out again later
        elif outcome == "hold":
            self.running.append(proxy)  # still running while other copies are delivered
        else:
            self.finish(proxy, outcome)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), outcome=st.sampled_from(["success", "failure"]))
    def finish_a_run(self, data: st.DataObject, outcome: str) -> None:
        proxy = data.draw(st.sampled_from(self.running))
        self.running.remove(proxy)
        self.finish(proxy, outcome)

    def begin(self, proxy: MessageProxy) -> bool:
        """The before-hooks, as a worker runs them: True when the actor starts."""
        self.step += 1
        try:
            self.broker.emit_before("process_message", proxy)
        except SkipMessage:
            self.broker.emit_after("skip_message", proxy)
            self.settle(proxy)
            return False
        self.start(proxy)
        return True

    def finish(self, proxy: MessageProxy, outcome: str) -> None:
        self.step += 1
        if outcome == "failure":
            self.broker.emit_after("process_message", proxy, exception=RuntimeError("the actor failed"))
        else:
            self.successes[proxy.message_id] = self.successes.get(proxy.message_id, 0) + 1
            self.broker.emit_after("process_message", proxy, result=None)
        self.settle(proxy)

    def settle(self, proxy: MessageProxy) -> None:
        if proxy.failed:
            self.exhausted.add(proxy.message_id)
            self.broker.emit_before("nack", proxy)
            self.broker.emit_after("nack", proxy)
        else:
            self.broker.emit_before("ack", proxy)
            self.broker.emit_after("ack", proxy)
        # Run locks on Redis are released, and their waiters handed over,
        # in the background: settle that before the next step looks.
        wait_for_releases(self.middleware)
        self.collect()

    def start(self, proxy: MessageProxy) -> None:
        message_id = proxy.message_id
        superseded = self.superseded_at.get(message_id)
        assert superseded is None or superseded > self.step, f"{message_id} started after it was superseded"
        self.started.add(message_id)

    # Invariants -----------------------------------------------------------------

    @invariant()
    def each_message_succeeds_at_most_once(self) -> None:
        assert all(count == 1 for count in self.successes.values())

    @invariant()
    def no_lock_is_lost(self) -> None:
        # Replacing a started holder leaves it its own slot to release.
        assert not self.never_lost or self.middleware.events.count("lock_lost") == 0

    @invariant()
    def the_newest_message_holds_the_key_until_it_starts(self) -> None:
        if self.newest is None or self.newest in self.started:
            return
        info = self.middleware.backend.inspect(self.key)  # type: ignore[union-attr]
        assert info is not None and info.current == self.newest and self.newest in info.holders

    def teardown(self) -> None:
        # Drain: every run ends, every copy left is moved and delivered, and succeeds.
        for proxy in self.running:
            self.finish(proxy, "success")
        for _ in range(1000):
            if not self.pool:
                break
            message = self.pool.pop(0)
            if message.queue_name == dq_name(QUEUE):
                moved = message.copy(queue_name=QUEUE)
                del moved.options["eta"]
                self.broker.enqueue(moved)
                self.collect()
            else:
                proxy = MessageProxy(message)
                if self.begin(proxy):
                    self.finish(proxy, "success")
        assert not self.pool, f"the queues did not drain: {self.pool[:3]}"
        if self.newest is not None and self.newest not in self.exhausted:
            assert self.successes.get(self.newest) == 1, "the newest message did not run once"
        backend = self.middleware.backend
        assert backend is not None
        wait_for_releases(self.middleware)  # run locks on Redis are released in the background
        keys = list(backend.scan(f"{self.prefix}:*"))
        # Superseded and message records expire on their own; locks and waiters must be gone.
        assert [key for key in keys if key.endswith((":queue", ":run", ":wait", ":bodies"))] == [], "a lock was left"
        self.middleware.after_worker_shutdown(self.broker, None)  # type: ignore[arg-type]
        self.broker.close()
        if isinstance(backend, RedisBackend):
            if keys:
                backend.client.delete(*keys)
            backend.client.close()


class UntilExecutingMachine(ReplaceMachine):
    lock = "until_executing"
    never_lost = False


class UntilAndWhileExecutingMachine(ReplaceMachine):
    lock = "until_and_while_executing"
    never_lost = False


MACHINES = [ReplaceMachine, UntilExecutingMachine, UntilAndWhileExecutingMachine]


def settings_for(examples: int) -> settings:
    return settings(max_examples=examples, stateful_step_count=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("machine", MACHINES)
def test_replace_rules(machine: type[ReplaceMachine]) -> None:
    run_state_machine_as_test(machine, settings=settings_for(60))


@pytest.mark.parametrize("machine", MACHINES)
def test_replace_rules_with_locks_on_redis(machine: type[ReplaceMachine], redis_url: str) -> None:
    on_redis = type(f"Redis{machine.__name__}", (machine,), {"redis_url": redis_url})
    run_state_machine_as_test(on_redis, settings=settings_for(15))


@pytest.mark.soak
@pytest.mark.parametrize("machine", MACHINES)
def test_replace_rules_soak(machine: type[ReplaceMachine], redis_url: str) -> None:
    run_state_machine_as_test(machine, settings=settings_for(1000))
    on_redis = type(f"Redis{machine.__name__}", (machine,), {"redis_url": redis_url})
    run_state_machine_as_test(on_redis, settings=settings_for(200))
