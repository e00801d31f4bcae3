"""The hand-off model, explored: every copy of a message, in any order.

One logical message can exist as several copies at once: the original,
the delayed and the handed-over copy of each reschedule, Retries'
re-enqueues of each, broker redeliveries after a crash, and the moves
out of the delay queue.  This state machine drives the real middleware
hooks, in the order Dramatiq's worker fires them, on a ``StubBroker``
with ``AgeLimit``, ``Retries`` and ``Results``, over a ``StubBackend``
whose calls can time out before they are applied or after (a lost
reply), and whose run lock calls can be broken by a time limit that
strikes the worker thread mid-call; the broker's enqueues made by the
middleware (a delayed copy, a hand-off) can fail before or after they
are applied too, and a release that failed is sent again by a rule,
which a fault can fail again, for a while.  The rules deliver any queued copy
in any order, and the invariants of ``docs/reliability.md`` ("The
hand-off model") are checked after every step and once everything has
drained.

A worker process can also stop while its lock backend does not answer,
with releases still owed: its shutdown writes them to the broker as a
message of the internal owed-releases actor, which may be lost or
delivered twice, and a rule makes any such message, as the next worker
would.

It runs twice: releasing each run lock in its own call, and releasing
in the background as on Redis, where a release waits in the releaser
until it rides in front of the next start, in the same call, or the
releaser thread sends it; here that thread is a rule, so that any
interleaving of sends, starts, lost replies and interrupts is explored.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from typing import Any, Callable, Iterator, Optional

import dramatiq
import pytest
from dramatiq import Message
from dramatiq.broker import MessageProxy
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import AgeLimit, Callbacks, Pipelines, Retries, SkipMessage, TimeLimitExceeded
from dramatiq.middleware import age_limit as age_limit_module
from dramatiq.results import Results
from dramatiq.results.backends import StubBackend as ResultsStub
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from dramatiq_unique import LockBackendError, StubBackend, UniqueMiddleware
from dramatiq_unique.backends.base import LockBackend
from dramatiq_unique.backends.capabilities import BatchedReleases, NewestWins, Reschedules, release_then_start
from dramatiq_unique.model.wire import message_id_of
from dramatiq_unique.events import LockEvent
from dramatiq_unique.worker.resend import OWED_ACTOR
from dramatiq_unique.worker.release import Releaser
from dramatiq_unique.worker.resend import FailedReleases

MAX_RETRIES = 1
#: The model's shutdown bound, in ms: what a stopping worker cannot send
#: within it (its lock backend is down) is owed.
SHUTDOWN_TIMEOUT = 50
KEYS = (1,)  # one key per actor: every send contends, which is where the bugs live

#: The actors under test: the seed's while_executing, and the
#: documented "enqueue once, run serialized" lock.
ACTORS = {
    "work": {"lock": "while_executing", "on_conflict": {"server": "reschedule"}},
    "sync": {"lock": "until_and_while_executing", "on_conflict": {"server": "reschedule"}},
    "once": {"lock": "until_executed"},
}

#: Calls that a fault may hit (renewals run on their own thread).
FAULTY_CALLS = sorted(
    {name for kind in (Reschedules, NewestWins) for name in kind.__abstractmethods__}
    - {"extend", "inspect", "scan", "delete_prefix"}
)
#: The calls of a worker thread that a time limit can break: taking the
#: run lock, with the releases riding in front of it.
INTERRUPTIBLE_CALLS = {"start", "release_and_start"}
#: What can happen to the next call: it times out before it is applied,
#: or after (its reply lost, as with a stalled or partitioned Redis); or
#: a time limit breaks it, before or after it was applied.
FAULTS = ("before", "after", "interrupted before", "interrupted after")


class FaultyBackend(StubBackend):
    """A ``StubBackend`` whose next call from the model's own thread can
    fail as ``FAULTS`` say.  Calls from background threads (confirmations,
    say) are never hit: the clock decides when they come, and an example
    must replay alike.
    """

    fault: Optional[str] = None
    #: Every call from the model's thread fails, before it is applied:
    #: the lock backend is out of reach (while a worker stops).
    down = False

    def __init__(self) -> None:
        super().__init__()
        self.model_thread = threading.get_ident()

    def entries(self) -> dict[str, Any]:
        """Every key's entry, as the stub keeps it (lapsed slots too)."""
        return self._entries

    def lapse(self, key: str, owner: str) -> None:
        """Time passes for ``owner``'s slot of ``key``: its deadline is past."""
        self._entries[key].holders[owner] = 0

    def reservations_run_out(self) -> None:
        """Time passes: every slot reserved for a waiter is free again."""
        for entry in self._entries.values():
            entry.reserved = {message: 0 for message in entry.reserved}

    def waiting(self) -> bool:
        return any(waiters.order for waiters in self._waiters.values())

    def close(self) -> None:
        pass


class BatchingBackend(FaultyBackend, BatchedReleases):
    """The same, releasing in the background as the Redis backend does:
    a release and the start it rides with are one call, which a fault
    hits whole, and so is a batch of the releaser thread.
    """

    def release_and_start(self, releases: Any, key: str, owner: str, **start: Any) -> Any:
        return release_then_start(self, releases, key, owner, **start)


def postgres_backends(url: str) -> tuple[type, type]:
    """FaultyBackend and BatchingBackend on PostgresBackend at ``url``:
    the same rules, run on the state of each key stored in PostgreSQL.
    """
    from dramatiq_unique.backends.postgres import PostgresBackend, sql
    from dramatiq_unique.backends.postgres.state import loaded

    class FaultyPostgres(PostgresBackend):
        fault: Optional[str] = None
        down = False
        batches_releases = False  # released in its own call: the model's first mode

        def __init__(self) -> None:
            super().__init__(url=url)
            self.model_thread = threading.get_ident()
            self.create_schema()
            with self._connection() as conn:
                conn.execute(f"DELETE FROM {sql.LOCKS}")

        def _snapshot(self) -> tuple[StubBackend, dict[str, Any]]:
            """A stub holding every key's state, and the keys."""
            with self._connection() as conn:
                return loaded(conn.execute(f"SELECT key, state::text, NULL FROM {sql.LOCKS}").fetchall())

        def entries(self) -> dict[str, Any]:
            stub, keys = self._snapshot()
            return {key: entry for key in keys if (entry := stub.key_state(key).entry) is not None}

        def lapse(self, key: str, owner: str) -> None:
            def lapsed(stub: StubBackend) -> None:
                entry = stub.key_state(key).entry
                if entry is not None and owner in entry.holders:
                    entry.holders[owner] = 0

            self._locked([key], lapsed)

        def reservations_run_out(self) -> None:
            _, keys = self._snapshot()

            def ran_out(stub: StubBackend) -> None:
                for key in keys:
                    entry = stub.key_state(key).entry
                    if entry is not None:
                        entry.reserved = {message: 0 for message in entry.reserved}

            if keys:
                self._locked(list(keys), ran_out)

        def waiting(self) -> bool:
            stub, keys = self._snapshot()
            return any((waiters := stub.key_state(key).waiters) is not None and waiters.order for key in keys)

    class BatchingPostgres(FaultyPostgres):
        batches_releases = True

    return _with_faults(FaultyPostgres, BatchingPostgres, PostgresBackend)


class SteppedReleaser(Releaser):
    """The releaser, with its thread's work done by a rule of the model."""

    def _ensure_thread(self) -> None:
        self._running = True

    def busy(self) -> bool:
        return bool(self._pending or self._follow_ups)

    def step(self) -> None:
        """What the releaser thread does when it wakes: the hand-offs
        left to do, then what no start carried, in one call.
        """
        with self._wakeup:
            batch, follow_ups, self._follow_ups = self._due(force=True), self._follow_ups, []
            self._sending = batch
        self._send(batch, follow_ups)


class SteppedRetries(FailedReleases):
    """The retries of failed releases, with their thread's work done by
    a rule of the model.
    """

    def _ensure_thread(self) -> None:
        self._running = True


def _faulty(name: str, applied: Callable[..., Any]) -> Callable[..., Any]:
    def call(self: FaultyBackend, *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != self.model_thread:
            return applied(self, *args, **kwargs)
        if self.down:
            raise TimeoutError(f"{name} timed out: the lock backend is out of reach")
        if (self.fault or "").startswith("interrupted") and name not in INTERRUPTIBLE_CALLS:
            return applied(self, *args, **kwargs)  # a time limit strikes the worker thread's start only
        fault, self.fault = self.fault, None  # the calls this one makes inside are not hit again
        if fault == "before":
            raise TimeoutError(f"{name} timed out before it reached the backend")
        if fault == "interrupted before":
            raise TimeLimitExceeded(f"a time limit broke {name} before it was sent")
        result = applied(self, *args, **kwargs)
        if fault == "after":
            raise TimeoutError(f"the reply to {name} was lost")
        if fault == "interrupted after":
            raise TimeLimitExceeded(f"a time limit broke {name} after it was applied")
        return result

    return call


def _with_faults(faulty: type, batching: type, base: type) -> tuple[type, type]:
    for name in FAULTY_CALLS:
        setattr(faulty, name, _faulty(name, getattr(base, name)))
    if base.release_many is not LockBackend.release_many:
        # One call of its own (PostgreSQL: one transaction), not a release per lock: a fault hits it whole.
        faulty.release_many = _faulty("release_many", base.release_many)
    for name in ("release_many", "release_and_start"):
        own = getattr(base, name) if name in vars(faulty) else getattr(batching, name)
        setattr(batching, name, _faulty(name, own))
    return faulty, batching


_with_faults(FaultyBackend, BatchingBackend, StubBackend)


class FaultyBroker(StubBroker):
    """A ``StubBroker`` whose next enqueue made by the middleware itself
    (a reschedule's delayed copy, a hand-off) fails before it is
    applied, or after (the message is queued, and the caller sees a
    reset), as a Redis or RabbitMQ publish can; or is applied twice and
    returns, as Dramatiq's RabbitMQ broker does when a publish whose
    confirm was lost is published again on a new connection.
    """

    fault: Optional[str] = None
    #: How many times each message was published twice.
    doubled: "Counter[str]"
    #: The next enqueue made by Retries fails before it is applied.
    lose_retry: bool = False

    def enqueue(self, message: Any, *, delay: Optional[int] = None) -> Any:
        if self.lose_retry and message.options.get("retries") and not _called_by_the_middleware():
            self.lose_retry = False
            raise ConnectionError("the retry's enqueue failed: the broker is unreachable")
        if self.fault is None or not _called_by_the_middleware():
            return super().enqueue(message, delay=delay)
        fault, self.fault = self.fault, None
        if fault == "twice":
            self.doubled[message.message_id] += 1
            super().enqueue(message, delay=delay)
            return super().enqueue(message, delay=delay)
        if fault == "before":
            raise ConnectionError("the enqueue failed before it reached the broker")
        super().enqueue(message, delay=delay)
        raise ConnectionError("the reply to the enqueue was lost")


def _called_by_the_middleware() -> bool:
    """Whether the enqueue under way comes from the middleware's own
    code, not through its guard of ``broker.enqueue`` (Retries, a move).
    """
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__") == "dramatiq_unique.send.context":
        frame = frame.f_back
    return frame is not None and str(frame.f_globals.get("__name__", "")).startswith("dramatiq_unique")


class RecordingResults(ResultsStub):
    """Results that remember every store, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.stored: list[tuple[str, str, Any]] = []

    def store_result(self, message: Any, result: Any, ttl: int) -> None:
        self.stored.append((message.message_id, "result", result))
        super().store_result(message, result, ttl)

    def store_exception(self, message: Any, exception: Exception, ttl: int) -> None:
        self.stored.append((message.message_id, "exception", type(exception).__name__))
        super().store_exception(message, exception, ttl)


def result_of(message_id: str) -> str:
    return f"ran {message_id}"


class Flight:
    """A delivery whose actor has started and not finished."""

    def __init__(self, proxy: MessageProxy, encoded: bytes) -> None:
        self.proxy, self.encoded = proxy, encoded


class HandoffModel(RuleBasedStateMachine):
    #: Release run locks in the background, as on Redis.
    batching = False
    #: Let the middleware's enqueues be applied twice (the soak run only).
    duplicates = False
    #: The lock backends: without and with batched releases.
    backends: tuple[type, type] = (FaultyBackend, BatchingBackend)

    def __init__(self) -> None:
        super().__init__()
        self.broker = FaultyBroker(middleware=[AgeLimit(), Callbacks(), Pipelines(), Retries(max_retries=MAX_RETRIES)])
        self.broker.doubled = Counter()
        self.results = RecordingResults()
        self.broker.add_middleware(Results(backend=self.results))
        self.locks = self.backends[1]() if self.batching else self.backends[0]()
        self.unique = UniqueMiddleware(backend=self.locks, reschedule_delay=1000, shutdown_timeout=SHUTDOWN_TIMEOUT)
        self.releaser: Optional[SteppedReleaser] = None
        if self.batching:
            threads = self.unique.threads
            self.releaser = SteppedReleaser(
                self.locks, reports=self.unique.unlocker, on_stalled=threads.troubles.releases_stalled
            )
            threads._releaser = self.releaser
        self.retries = SteppedRetries(self.locks, reports=self.unique.unlocker)
        self.unique.threads._failed = self.retries
        self.broker.add_middleware(self.unique)
        self.actors = {
            name: dramatiq.actor(
                lambda key: None,
                broker=self.broker,
                actor_name=name,
                queue_name="q",
                store_results=True,
                max_age=3_600_000,
                **options,
            )
            for name, options in ACTORS.items()
        }
        self.unique.before_worker_boot(self.broker, None)  # places itself, as a worker's boot does
        self.pool: list[tuple[str, bytes]] = []  # (queue name, encoded copy), queued anywhere
        self.flights: list[Flight] = []
        self.sent: dict[str, str] = {}  # message id -> actor
        self.starts: Counter[str] = Counter()
        self.crashes: Counter[str] = Counter()
        self.dead: Counter[str] = Counter()
        self.dead_of_backend_errors: Counter[str] = Counter()
        self.succeeded: set[str] = set()
        self.failures: Counter[str] = Counter()  # runs whose actor raised: each may be retried
        self.aged = False
        self.failed_releases: set[tuple[str, Optional[str]]] = set()  # (key, message id): reported, left to the lease
        self.dead_owners: set[Optional[str]] = set()  # run lock owners whose worker died
        self.expired: set[tuple[str, Optional[str]]] = set()  # (key, message id): freed by its lease running out
        self.false_losses: list[tuple[str, Optional[str]]] = []
        self.stopped: set[tuple[str, str]] = set()  # (key, owner): owed by a worker that stopped
        self.owed_lost: set[tuple[str, str]] = set()  # of those, the ones whose owed message was lost
        self.unique.events.subscribe(self.heard)
        self.init_finish_rules()

    def heard(self, event: LockEvent) -> None:
        if event.name == "backend_error":
            self.failed_releases.add((event.key, event.message_id))
        elif event.name == "lock_lost" and event.key.endswith(":run"):
            if (event.key, event.message_id) not in self.expired:
                self.false_losses.append((event.key, event.message_id))
        self.heard_by_finish_rules(event)

    # The network ---------------------------------------------------------------------

    def collect(self) -> None:
        """Move what the broker enqueued into the pool of queued copies."""
        for name, queue in self.broker.queues.items():
            while not queue.empty():
                self.pool.append((name, queue.get_nowait()))

    def take(self, index: int, delayed: bool) -> Optional[tuple[str, bytes]]:
        candidates = [i for i, (name, raw) in enumerate(self.pool)
                      if name.endswith(".DQ") == delayed and (delayed or not is_owed(raw))]
        if not candidates:
            return None
        return self.pool.pop(candidates[index % len(candidates)])

    def post_process(self, proxy: MessageProxy) -> None:
        """Ack or nack, as the consumer does after every delivery."""
        verb = "nack" if proxy.failed else "ack"
        self.broker.emit_before(verb, proxy)
        if proxy.failed:
            self.dead[proxy.message_id] += 1
            self.dead_letters.append(proxy.encode())
            if isinstance(proxy._exception, (LockBackendError, TimeLimitExceeded)):
                # Retries gave up on a copy whose lock call failed every time: the backend
                # failed, or a time limit broke the call (here only faults raise TimeLimitExceeded)
                self.dead_of_backend_errors[proxy.message_id] += 1
        self.broker.emit_after(verb, proxy)

    # Rules ---------------------------------------------------------------------------

    @initialize(actor=st.sampled_from(sorted(ACTORS)))
    def a_reschedule_in_flight(self, actor: str) -> None:
        """Every example starts at the seam: one message of the key
        running, and a second one rescheduled behind it.
        """
        self.send(actor, KEYS[0])
        self.deliver(0)
        self.send(actor, KEYS[0])
        self.deliver(0)

    @rule(actor=st.sampled_from(sorted(ACTORS)), key=st.sampled_from(KEYS))
    def send(self, actor: str, key: int) -> None:
        try:
            message = self.actors[actor].send(key)
        except LockBackendError:
            return  # the caller is told; nothing was enqueued
        if "unique_duplicate_of" not in message.options:
            self.sent[message.message_id] = actor
        self.collect()

    def queued(self, delayed: bool) -> bool:
        return any(name.endswith(".DQ") == delayed for name, _ in self.pool)

    @precondition(lambda self: self.queued(delayed=False))
    @rule(index=st.integers(0, 50))
    def deliver(self, index: int) -> None:
        """A worker receives any queued copy and runs its before-hooks."""
        taken = self.take(index, delayed=False)
        if taken is None:
            return
        proxy = MessageProxy(Message.decode(taken[1]))
        try:
            self.broker.emit_before("process_message", proxy)
        except SkipMessage as e:
            if proxy.failed:
                proxy.stuff_exception(e)
            self.broker.emit_after("skip_message", proxy)
            self.post_process(proxy)
        except BaseException as e:
            proxy.stuff_exception(e)
            self.broker.emit_after("process_message", proxy, exception=e)
            self.post_process(proxy)
        else:
            assert proxy.message_id not in self.succeeded, f"{proxy.message_id} started again after it succeeded"
            self.started_in_order(proxy)
            self.starts[proxy.message_id] += 1
            self.flights.append(Flight(proxy, taken[1]))
        self.collect()

    @precondition(lambda self: self.flights)
    @rule(index=st.integers(0, 50), fails=st.booleans())
    def finish(self, index: int, fails: bool) -> None:
        """A started actor returns or raises; the after-hooks run."""
        if not self.flights:
            return
        proxy = self.flights.pop(index % len(self.flights)).proxy
        if fails:
            error = ValueError("the actor failed")
            self.failures[proxy.message_id] += 1
            proxy.stuff_exception(error)
            self.broker.emit_after("process_message", proxy, exception=error)
        else:
            self.broker.emit_after("process_message", proxy, result=result_of(proxy.message_id))
            self.succeeded.add(proxy.message_id)
        self.post_process(proxy)
        self.collect()

    @precondition(lambda self: self.queued(delayed=True))
    @rule(index=st.integers(0, 50))
    def move(self, index: int) -> None:
        """The delay-queue consumer moves a due copy to its queue, then
        acks the delayed copy.
        """
        taken = self.take(index, delayed=True)
        if taken is None:
            return
        proxy = MessageProxy(Message.decode(taken[1]))
        moved = proxy.copy(queue_name=taken[0][: -len(".DQ")])
        del moved.options["eta"]
        self.broker.enqueue(moved)  # a re-enqueue: it must never raise
        self.post_process(proxy)
        self.collect()

    @precondition(lambda self: self.flights)
    @rule(index=st.integers(0, 50))
    def crash(self, index: int) -> None:
        """The worker running a started actor dies: no hooks run, the
        broker redelivers the message as it was, and its run lock stays
        held until its lease runs out (``leases_run_out``).
        """
        if not self.flights:
            return
        flight = self.flights.pop(index % len(self.flights))
        state = flight.proxy._unique_delivery
        if state.lease is not None:
            self.unique.threads.leases.drop(state.lease)
        self.dead_owners.add(state.run_owner)
        self.crashes[flight.proxy.message_id] += 1
        self.pool.append((flight.proxy.queue_name, flight.encoded))

    @rule()
    def leases_run_out(self) -> None:
        """Time passes: every run lock that no running delivery renews
        (its release failed, or its worker died) reaches its deadline.
        """
        self.order_may_break()
        renewed = {f.proxy._unique_delivery.run_owner for f in self.flights}
        on_the_way = {(p.key, p.owner) for p in self.releaser._pending} if self.releaser is not None else set()
        for key, entry in list(self.locks.entries().items()):
            for owner in set(entry.holders) - renewed:
                if key.endswith(":run"):
                    # Only a lock whose release failed, and said so, or is on its way, outlives its holder.
                    known = (key, owner) in on_the_way or (key, message_id_of(owner)) in self.failed_releases
                    known = known or owner in self.dead_owners or (key, owner) in self.stopped
                    assert known, f"{key} of {owner} was never released, and no error said so"
                    self.locks.lapse(key, owner)  # its deadline passed: the slot is free, and no release ran
                    self.expired.add((key, message_id_of(owner)))
        self.reservations_run_out()

    @rule(fault=st.sampled_from(FAULTS))
    def fail_next_call(self, fault: str) -> None:
        """The next lock call times out, or a time limit breaks it."""
        self.order_may_break()
        self.locks.fault = fault

    @rule(fault=st.sampled_from(("before", "after", "twice")))
    def fail_next_enqueue(self, fault: str) -> None:
        """The middleware's next enqueue fails before the broker applied
        it, or after (its reply lost), or is applied twice (only in the
        soak run: see ``docs/reliability.md``, a duplicate whose first
        run's release never landed).
        """
        self.order_may_break()
        if fault == "twice" and not self.duplicates:
            fault = "after"
        self.broker.fault = fault

    @precondition(lambda self: self.releaser is not None and self.releaser.busy() and self.queued(delayed=False))
    @rule(fault=st.sampled_from(FAULTS), index=st.integers(0, 50))
    def a_start_carrying_releases_fails(self, fault: str, index: int) -> None:
        """The seam of background releases, aimed at: a copy is delivered
        while releases wait to ride with its start, and that call fails.
        """
        self.fail_next_call(fault)
        self.deliver(index)

    @precondition(lambda self: self.releaser is not None and self.releaser.busy())
    @rule()
    def releaser_sends(self) -> None:
        """The releaser thread wakes: it hands over the keys that reports
        left to it, and sends the releases that no start carried.
        """
        assert self.releaser is not None
        self.releaser.step()
        self.collect()

    @precondition(lambda self: self.retries.pending())
    @rule()
    def failed_releases_are_sent_again(self) -> None:
        """The retry thread wakes: it sends every failed release again
        (a fault can fail it again, for a while).
        """
        self.retries.step(force=True)
        self.collect()

    @precondition(lambda self: not self.aged)
    @rule()
    def age_out(self) -> None:
        """Time passes: every message is now older than its max_age."""
        self.order_may_break()
        self.aged = True

    # Issue 29: the finish rule, replays, and hand-offs in send order -----------------
    # (kept apart from the other rules and invariants, so that other additions merge)

    def init_finish_rules(self) -> None:
        self.dead_letters: list[bytes] = []  # encoded copies, as the dead-letter queue holds them
        self.replays: list[tuple[str, int, int]] = []  # (message id, its starts and dead letters at the replay)
        self.replayed: Counter[str] = Counter()
        self.waiting: dict[str, int] = {}  # rescheduled, not started since: the step it began to wait
        self.step = 0
        self.inversions: list[tuple[str, str]] = []  # (a waiter, a later message that started before it)
        #: No fault yet that may hand a key out of order (a lost call, a lost enqueue, time passing).
        self.order_kept = True

    def heard_by_finish_rules(self, event: LockEvent) -> None:
        if event.name == "rescheduled" and event.message_id is not None:
            self.step += 1
            self.waiting.setdefault(event.message_id, self.step)

    def started_in_order(self, proxy: MessageProxy) -> None:
        """A message starts: no message of its actor sent before it may
        still be waiting, if it already waited when this one began to
        wait (or to run).
        """
        started = proxy.message_id
        self.step += 1
        since = self.waiting.pop(started, self.step)
        if not self.order_kept or started not in self.sent:
            return
        order = list(self.sent)
        mine = order.index(started)
        ahead = [w for w, began in self.waiting.items()
                 if self.sent.get(w) == self.sent[started] and order.index(w) < mine and began < since]
        self.inversions.extend((waiter, started) for waiter in ahead if not self.dead[waiter])

    def order_may_break(self) -> None:
        self.order_kept = False

    def reservations_run_out(self) -> None:
        """Time passes: every slot reserved for a waiter is free again."""
        self.locks.reservations_run_out()

    @precondition(lambda self: self.flights)
    @rule(index=st.integers(0, 50))
    def a_failed_run_whose_retry_is_lost(self, index: int) -> None:
        """A run fails while the broker is unreachable: Retries' enqueue
        fails (Dramatiq logs it), the ack is lost too, and the broker
        delivers the copy that ran again.
        """
        if not self.flights:
            return
        flight = self.flights.pop(index % len(self.flights))
        proxy = flight.proxy
        error = ValueError("the actor failed")
        self.failures[proxy.message_id] += 1
        self.crashes[proxy.message_id] += 1  # the copy given back may start again
        proxy.stuff_exception(error)
        self.broker.lose_retry = True
        try:
            self.broker.emit_after("process_message", proxy, exception=error)
        finally:
            self.broker.lose_retry = False
        if proxy.failed:
            self.post_process(proxy)  # Retries gave up: no enqueue to lose, it is dead-lettered
        else:
            self.pool.append((proxy.queue_name, flight.encoded))
        self.collect()

    def replayable(self) -> list[bytes]:
        return [e for e in self.dead_letters if Message.decode(e).message_id not in self.succeeded]

    @precondition(lambda self: self.replayable())
    @rule(index=st.integers(0, 50), reset=st.booleans())
    def an_operator_replays_a_dead_letter(self, index: int, reset: bool) -> None:
        """An operator moves a dead-lettered copy back to its queue, as
        it is or with its retries reset.
        """
        candidates = self.replayable()
        encoded = candidates[index % len(candidates)]
        self.dead_letters.remove(encoded)
        message = Message.decode(encoded)
        if reset:
            message = message.copy(options={"retries": 0})
        replayed = message.message_id
        self.replays.append((replayed, self.starts[replayed], self.dead[replayed]))
        self.replayed[replayed] += 1
        self.crashes[replayed] += 1 + MAX_RETRIES  # it may run, and be retried, again
        self.pool.append((message.queue_name, message.encode()))

    def handoffs_on_their_way(self) -> bool:
        return any(Message.decode(e).options.get("unique_via") == "handoff" for n, e in self.pool
                   if not n.endswith(".DQ"))

    @precondition(lambda self: self.handoffs_on_their_way())
    @rule(index=st.integers(0, 50), send=st.booleans())
    def others_arrive_while_a_handoff_is_on_its_way(self, index: int, send: bool) -> None:
        """While a hand-off copy is queued, another copy of the key comes
        first: a new send, another waiter's delayed copy, anything queued.
        """
        if send:
            self.send(sorted(self.actors)[index % len(self.actors)], KEYS[0])
        ready = [i for i, (name, _) in enumerate(self.pool) if not name.endswith(".DQ")]
        others = [p for p, i in enumerate(ready)
                  if Message.decode(self.pool[i][1]).options.get("unique_via") != "handoff"]
        if others:
            self.deliver(others[index % len(others)])
        elif self.queued(delayed=True):
            self.move(index)

    @invariant()
    def waiters_are_handed_the_key_in_send_order(self) -> None:
        assert not self.inversions, f"started before a waiter sent earlier: {self.inversions}"

    def replays_ran_again(self) -> None:
        """A replayed dead-lettered message runs again (or is
        dead-lettered again, by AgeLimit or its retries).
        """
        for message_id, starts, dead in self.replays:
            assert self.starts[message_id] > starts or self.dead[message_id] > dead, f"replay of {message_id} dropped"

    # Invariants ----------------------------------------------------------------------

    @invariant()
    def runs_of_one_key_never_overlap(self) -> None:
        running = Counter((f.proxy.actor_name, tuple(f.proxy.args)) for f in self.flights)
        assert all(count <= 1 for count in running.values()), running

    @invariant()
    def no_message_starts_more_than_its_retries_allow(self) -> None:
        for message_id, starts in self.starts.items():
            assert starts <= 1 + MAX_RETRIES + self.crashes[message_id], (message_id, starts)

    @invariant()
    def a_message_starts_again_only_after_a_failure_or_a_crash(self) -> None:
        for message_id, starts in self.starts.items():
            assert starts <= 1 + self.failures[message_id] + self.crashes[message_id], (message_id, starts)

    @invariant()
    def no_message_is_dead_lettered_twice(self) -> None:
        # ...unless its lock call failed on every attempt of a copy, or the broker published
        # a copy twice and both are retired: a claim sent again after its lost reply looks
        # the same as the second copy's (see the docs)
        allowed = {m: 1 + self.dead_of_backend_errors[m] + self.broker.doubled[m] + self.replayed[m] for m in self.dead}
        assert all(count <= allowed[m] for m, count in self.dead.items()), self.dead

    @invariant()
    def a_run_lock_is_reported_lost_only_when_its_lease_ran_out(self) -> None:
        assert not self.false_losses, self.false_losses

    @invariant()
    def a_result_is_only_ever_a_real_one(self) -> None:
        for message_id, kind, value in self.results.stored:
            if kind == "result":
                assert value == result_of(message_id), f"{message_id} stored {value!r} as its result"

    # Once everything has drained ----------------------------------------------------

    def drain(self) -> None:
        self.locks.fault = self.broker.fault = None
        for step in range(500):
            if step % 50 == 49:
                self.leases_run_out()
            if self.flights:
                self.finish(0, False)
            elif self.releaser is not None and self.releaser.busy():
                self.releaser_sends()
            elif self.retries.pending():
                self.failed_releases_are_sent_again()
            elif self.queued(delayed=True):
                self.move(0)
            elif self.owed_queued():
                self.owed_releases_are_made(0)
            elif self.pool:
                self.deliver(0)
            else:
                return
            self.check_all()
        pytest.fail(f"still not drained: {len(self.pool)} queued, {len(self.flights)} running")

    def check_all(self) -> None:
        self.waiters_are_handed_the_key_in_send_order()
        self.runs_of_one_key_never_overlap()
        self.no_message_starts_more_than_its_retries_allow()
        self.a_message_starts_again_only_after_a_failure_or_a_crash()
        self.no_message_is_dead_lettered_twice()
        self.a_result_is_only_ever_a_real_one()
        self.a_run_lock_is_reported_lost_only_when_its_lease_ran_out()
        self.a_stopped_workers_locks_are_held_only_while_their_release_is_owed()

    def teardown(self) -> None:
        try:
            self.drain()
            # Nothing is lost: each accepted message ran to success or was dead-lettered.
            lost = [m for m in self.sent if m not in self.succeeded and not self.dead[m]]
            assert not lost, f"never ran and never dead-lettered: {lost}"
            self.replays_ran_again()
            # Every run lock still held is one whose release failed, and said so: only its lease frees it.
            held = {(key, message_id_of(owner)) for key, entry in self.locks.entries().items()
                    if key.endswith(":run") for owner in entry.holders
                    if owner not in self.dead_owners and (key, owner) not in self.owed_lost}
            # Every release that failed was sent again until it landed: no run lock is left to its lease.
            assert self.retries.pending() == 0
            assert not held, f"never released: {held}"
            # No lock, waiter or hand-off body outlives the messages, once
            # the run locks whose release failed have reached their lease.
            self.leases_run_out()
            assert self.releaser is None or self.releaser.pending() == 0
            # (but an enqueue lock whose owed release the broker lost, which lasts its lock_ttl)
            left = [key for key in self.locks.scan("*") if key not in {k for k, _ in self.owed_lost}]
            assert not left, left
            assert not self.locks.waiting()
            # A new send of every key is accepted (but those).
            for actor in self.actors.values():
                for key in KEYS:
                    if not any(self.unique.specs[actor.actor_name].actor_name in k for k, _ in self.owed_lost):
                        assert "unique_duplicate_of" not in actor.send(key).options
        finally:
            self.unique.after_worker_shutdown(self.broker, None)
            self.broker.close()
            self.locks.close()


    # A worker that stops with releases still owed ------------------------------------

    def owes(self) -> bool:
        busy = self.releaser is not None and (self.releaser.busy() or self.releaser._sending)
        return bool(self.retries.pending() or busy)

    def owed_queued(self) -> bool:
        return any(not name.endswith(".DQ") and is_owed(raw) for name, raw in self.pool)

    @precondition(lambda self: not self.flights and self.owes())
    @rule(fate=st.sampled_from(("delivered", "lost", "twice")))
    def a_worker_stops_owing_releases(self, fate: str) -> None:
        """The worker process stops (SIGTERM) while its lock backend does
        not answer: its shutdown writes the releases it could not send
        to the broker, and the process is gone.  That message may be
        lost, or delivered twice (``fail_next_enqueue`` may also hit its
        enqueue).
        """
        releaser = self.releaser
        owed = {(f.key, f.owner) for f in self.retries._failed}
        if releaser is not None:
            owed |= {(p.key, p.owner) for p in releaser._pending + releaser._sending}
        before = Counter(raw for _, raw in self.pool)
        broker_fails = self.broker.fault in ("before", "after")
        self.locks.down = True
        try:
            self.unique.before_worker_shutdown(self.broker, None)
            self.unique.after_worker_shutdown(self.broker, None)
        finally:
            self.locks.down = False
        for thread in threading.enumerate():
            if thread.name == "dramatiq-unique-owed":
                thread.join()  # an enqueue that outlived the bound lands, or not, before we look
        if releaser is not None:  # nothing of the stopped process is left in memory
            releaser._pending, releaser._sending, releaser._follow_ups, releaser._riding = [], [], [], 0
        self.collect()
        written = [entry for entry in self.pool if is_owed(entry[1]) and not before[entry[1]]]
        in_pool = {pair for _, raw in written for pair in owed_in(raw)}
        assert in_pool <= owed, in_pool - owed
        # Only a broker that fails the write may leave a release unwritten (an ERROR names each).
        assert broker_fails or in_pool == owed, f"a stopping worker dropped the releases it owed: {owed - in_pool}"
        self.stopped |= owed
        self.owed_lost |= owed - in_pool  # the broker failed the write: an ERROR names each
        if fate == "lost":
            self.pool = [entry for entry in self.pool if entry not in written]
            self.owed_lost |= in_pool
        elif fate == "twice":
            self.pool += written

    @precondition(lambda self: self.owed_queued())
    @rule(index=st.integers(0, 50))
    def owed_releases_are_made(self, index: int) -> None:
        """A worker processes an owed-releases message: it makes each
        release, and enqueues again, later, those the backend refused.
        A failure of that enqueue fails the message, which the broker
        then delivers again.
        """
        candidates = [i for i, (name, raw) in enumerate(self.pool) if not name.endswith(".DQ") and is_owed(raw)]
        entry = self.pool.pop(candidates[index % len(candidates)])
        message = Message.decode(entry[1])
        try:
            self.unique.owed.make(*message.args, **message.kwargs)
        except Exception:
            self.pool.append(entry)
        self.collect()

    @invariant()
    def a_stopped_workers_locks_are_held_only_while_their_release_is_owed(self) -> None:
        # No key stays held past one lease after its holder's process is gone: each lock a
        # stopped worker owed is held only while its owed message is on its way (or was lost).
        on_the_way = {pair for _, raw in self.pool if is_owed(raw) for pair in owed_in(raw)}
        for key, owner in self.stopped - on_the_way - self.owed_lost:
            info = self.locks.inspect(key)
            assert info is None or owner not in info.holders, f"{key} of {owner} is held after its release was made"


def is_owed(raw: bytes) -> bool:
    """Whether an encoded message is one of the owed-releases actor."""
    return OWED_ACTOR.encode() in raw


def owed_in(raw: bytes) -> set[tuple[str, str]]:
    """The (key, owner) pairs an owed-releases message carries."""
    return {(release["key"], release["owner"]) for release in Message.decode(raw).args[0]}


@pytest.fixture
def aged_clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[HandoffModel]]:
    """AgeLimit's clock, an hour ahead once the running model aged out."""
    running: list[HandoffModel] = []
    real = age_limit_module.current_millis

    def now() -> int:
        return real() + (7_200_000 if running and running[-1].aged else 0)

    monkeypatch.setattr(age_limit_module, "current_millis", now)
    yield running


def explore(
    running: list[HandoffModel],
    examples: int,
    steps: int,
    *,
    batching: bool = False,
    duplicates: bool = False,
    backends: tuple[type, type] = (FaultyBackend, BatchingBackend),
) -> None:
    class Model(HandoffModel):
        def __init__(self) -> None:
            self.batching, self.duplicates, self.backends = batching, duplicates, backends
            super().__init__()
            running.append(self)

    run_state_machine_as_test(
        Model,
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
        ),
    )


# Hypothesis warns when the global random state moves while it draws; the
# model draws nothing from it, but other threads of the process may move
# it meanwhile (the jittered backoffs of redis-py, of release retries).
@pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies")
@pytest.mark.parametrize("batching", [False, True], ids=["release per call", "release in the background"])
def test_every_interleaving_of_copies_keeps_the_invariants(aged_clock: list[HandoffModel], batching: bool) -> None:
    explore(aged_clock, examples=300, steps=40, batching=batching)


@pytest.mark.parametrize("batching", [False, True], ids=["release per call", "release in the background"])
def test_every_interleaving_of_copies_keeps_the_invariants_on_postgres(
    aged_clock: list[HandoffModel], batching: bool, postgres_url: str
) -> None:
    # The same rules, on each key's state stored in PostgreSQL: fewer examples, each call a transaction.
    explore(aged_clock, examples=25, steps=30, batching=batching, backends=postgres_backends(postgres_url))


@pytest.mark.soak
@pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies")
@pytest.mark.parametrize("batching", [False, True], ids=["release per call", "release in the background"])
def test_every_interleaving_of_copies_keeps_the_invariants_long(aged_clock: list[HandoffModel], batching: bool) -> None:
    explore(aged_clock, examples=5_000, steps=80, batching=batching, duplicates=True)


def test_the_model_checks_what_it_claims() -> None:
    # A model that lets the lock through must be caught: the overlap invariant can fail.
    model = HandoffModel.__new__(HandoffModel)
    proxy = MessageProxy(Message(queue_name="q", actor_name="work", args=(1,), kwargs={}, options={}))
    model.flights = [Flight(proxy, b""), Flight(proxy, b"")]
    with pytest.raises(AssertionError):
        model.runs_of_one_key_never_overlap()
