"""The send fast path: on the Redis broker's own Redis, a new send takes
its enqueue lock and enqueues in one round trip, exactly as Dramatiq's
own enqueue would, with the two-step path's semantics; wherever that
cannot be known to be exact, the two steps are taken.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any, Iterator, Optional

import dramatiq
import pytest
import redis
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware import CurrentMessage, Middleware, Retries, default_middleware
from dramatiq.results import Results, ResultFailure
from dramatiq.results.backends import StubBackend as ResultsStub

from dramatiq_unique import DuplicateMessage, LockBackendError, UniqueMiddleware
from dramatiq_unique.backends.redis import RedisBackend
from dramatiq_unique.send.fastpath import dispatch_source
from tests.apps import sendpath as app
from tests.conftest import make_worker, wait_for
from tests.procs import WorkerGroup


class Hooks(dramatiq.Middleware):
    """Records the enqueue hooks it sees, and stamps an option that
    Dramatiq must encode.
    """

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def before_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
        message.options["stamped_by_hooks"] = True
        self.seen.append(("before", message.message_id))

    def after_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
        self.seen.append(("after", message.message_id))


#: Commands a new connection sends before its first command: not a
#: send's round trips.
_SET_UP = {b"HELLO", b"CLIENT", b"AUTH", b"SELECT", b"PING", b"READONLY"}


def _first_command(packed: Any) -> bytes:
    chunks = [packed] if isinstance(packed, (bytes, str)) else packed
    buffer = b"".join(c.encode() if isinstance(c, str) else bytes(c) for c in chunks)
    return buffer.split(b"\r\n", 3)[2].upper()


class RoundTrips:
    """Counts the Redis round trips this thread makes, connection set-up
    aside: one ``send_packed_command`` of redis-py (the lock backend's
    calls too) is one command or one pipeline.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        self.thread = threading.current_thread()
        original = redis.connection.Connection.send_packed_command

        def counted(conn: Any, command: Any, *args: Any, **kwargs: Any) -> None:
            self.counts(command)
            original(conn, command, *args, **kwargs)

        monkeypatch.setattr(redis.connection.Connection, "send_packed_command", counted)

    def counts(self, command: Any) -> None:
        if threading.current_thread() is self.thread and _first_command(command) not in _SET_UP:
            self.count += 1

    def of(self, send: Any) -> int:
        """The round trips ``send()`` makes."""
        before = self.count
        send()
        return self.count - before


@pytest.fixture
def namespace(redis_client: redis.Redis) -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def trips(monkeypatch: pytest.MonkeyPatch) -> RoundTrips:
    return RoundTrips(monkeypatch)


def new_broker(url: str, namespace: str, *middleware: Middleware, **unique: Any) -> RedisBroker:
    """A Redis broker with ``middleware``, then ours."""
    broker = RedisBroker(url=url, namespace=namespace)
    for m in middleware:
        broker.add_middleware(m)
    broker.add_middleware(UniqueMiddleware(prefix=namespace, **unique))
    broker.emit_after("process_boot")
    return broker


@pytest.fixture
def brokers() -> Iterator[list[Any]]:
    made: list[Any] = []
    yield made
    for broker in made:
        middleware_of(broker).flush_confirmations()  # the two-step sends' confirmations, before Redis goes
        broker.close()


def middleware_of(broker: Any) -> UniqueMiddleware:
    return next(m for m in broker.middleware if isinstance(m, UniqueMiddleware))


def events_of(broker: Any) -> list[tuple[str, Optional[str], Optional[str]]]:
    events: list[tuple[str, Optional[str], Optional[str]]] = []
    middleware_of(broker).events.subscribe(lambda e: events.append((e.name, e.message_id, e.holder)))
    return events


def stored(client: redis.Redis, namespace: str, queue: str) -> list[dict[str, Any]]:
    """The messages on a queue of the Redis broker, in order."""
    ids = client.lrange(f"{namespace}:{queue}", 0, -1)
    return [json.loads(client.hget(f"{namespace}:{queue}.msgs", i)) for i in ids]  # type: ignore[arg-type]


def enqueue_locks(client: redis.Redis, namespace: str) -> list[bytes]:
    return sorted(client.keys(f"{namespace}:*:queue"))


def lock_of(client: redis.Redis, namespace: str, message_id: str) -> Any:
    """The enqueue lock ``message_id`` holds."""
    backend = RedisBackend(client=client)
    held = [backend.inspect(key.decode()) for key in enqueue_locks(client, namespace)]
    [lock] = [lock for lock in held if lock is not None and message_id in lock.holders]
    return lock


def job_of(broker: Any, **options: Any) -> dramatiq.Actor:
    def job(key: str) -> None:
        pass

    options.setdefault("lock", "until_executed")
    return dramatiq.actor(job, broker=broker, lock_args=["key"], **options)


def shape(message: dict[str, Any]) -> tuple[Any, ...]:
    """What must match between a fast and a two-step send of one actor."""
    return (sorted(message), message["queue_name"], message["actor_name"], sorted(message["options"]))


# One round trip, the message Dramatiq would have enqueued ------------------


def test_the_installed_dramatiqs_dispatch_script_is_one_the_fast_path_knows(redis_url: str) -> None:
    broker = RedisBroker(url=redis_url, namespace="t-known")
    try:
        assert dispatch_source(broker) is not None, (
            f"Dramatiq {dramatiq.__version__}'s dispatch.lua is not in sendpath.KNOWN_DISPATCH: check that its "
            "enqueue command and arguments are unchanged, then add its SHA1."
        )
    finally:
        broker.close()


def test_a_new_send_is_one_round_trip_and_a_worker_runs_it_as_a_two_step_send(
    redis_url, redis_client, namespace, brokers, trips
):
    # Given the app's broker, whose sends take the fast path, and the same app with a later before_enqueue
    fast, job = app.build(redis_url, namespace)
    two_step, job_two = app.build(redis_url, namespace, two_step=True)
    brokers += [fast, two_step]
    job.send("warm-up")  # loads the scripts
    job_two.send("warm-up-2")
    # When a message is sent on each, now and with a delay
    assert trips.of(lambda: job.send("a")) == 1
    assert trips.of(lambda: job_two.send("b")) == 2
    assert trips.of(lambda: job.send_with_options(args=("c",), delay=300)) == 1
    job_two.send_with_options(args=("d",), delay=300)
    # Then the fast path enqueued what the two-step path enqueues, on the same queues
    *_, a, b = stored(redis_client, namespace, "default")
    c, d = stored(redis_client, namespace, "default.DQ")
    assert shape(a) == shape(b) and shape(c) == shape(d)
    assert "eta" in c["options"] and "unique_digest" in a["options"]
    # And its lock is confirmed at once, where the two-step path's waits for the confirmer
    record = lock_of(redis_client, namespace, a["message_id"]).records[a["message_id"]]
    assert record.provisional_until == 0 and record.where == f"{namespace}\tdefault\t{a['options']['redis_message_id']}"
    # And a dramatiq worker process runs all four as sent (and the warm-ups), and frees every key
    group = WorkerGroup(f"{app.__name__}:broker", processes=1, threads=2,
                        env={"SENDPATH_REDIS_URL": redis_url, "SENDPATH_NAMESPACE": namespace})
    with group:
        group.wait_booted(1, timeout=60)
        wait_for(lambda: redis_client.llen(f"{namespace}:runs") == 6, timeout=30, what="the six runs")
        wait_for(lambda: not enqueue_locks(redis_client, namespace), what="every enqueue lock to be released")
        assert group.stop(timeout=15) == 0
    runs = {run["message_id"]: run for run in map(json.loads, redis_client.lrange(f"{namespace}:runs", 0, -1))}
    for sent in (a, b, c, d):
        ran = runs[sent["message_id"]]
        assert ran["args"] == sent["args"] and ran["options"]["unique_digest"] == sent["options"]["unique_digest"]
    for sent in (a, b):
        assert runs[sent["message_id"]]["options"]["redis_message_id"] == sent["options"]["redis_message_id"]


def test_every_hook_fires_as_on_a_plain_enqueue(redis_url, redis_client, namespace, brokers, trips):
    # Given a middleware with enqueue hooks before ours
    hooks = Hooks()
    broker = new_broker(redis_url, namespace, hooks)
    brokers.append(broker)
    events = events_of(broker)
    job = job_of(broker)
    job.send("warm-up")
    # When a message is sent
    sent: list[Any] = []
    assert trips.of(lambda: sent.append(job.send("a"))) == 1
    # Then what the hooks changed was encoded, both hooks fired, and the lock was announced
    [_, queued] = stored(redis_client, namespace, "default")
    assert queued["message_id"] == sent[0].message_id and queued["options"]["stamped_by_hooks"] is True
    assert [s for s in hooks.seen if s[1] == sent[0].message_id] == [("before", sent[0].message_id),
                                                                     ("after", sent[0].message_id)]
    assert ("locked", sent[0].message_id, None) in events
    assert redis_client.zscore(f"{namespace}:__heartbeats__", broker.broker_id) is not None


def test_a_default_stack_takes_the_fast_path_before_and_after_a_worker_boots(
    redis_url, redis_client, namespace, brokers, trips
):
    # Given Dramatiq's default middleware, Results, CurrentMessage and ours, as a worker places them
    broker = RedisBroker(url=redis_url, namespace=namespace)
    brokers.append(broker)
    broker.add_middleware(Results(backend=ResultsStub()))
    broker.add_middleware(CurrentMessage())
    broker.add_middleware(UniqueMiddleware(prefix=namespace))
    assert {type(m) for m in broker.middleware} >= set(default_middleware)
    job = job_of(broker, store_results=True)
    job.send("warm-up")
    # Then a send is one round trip, before and after the middleware moved itself at boot
    assert trips.of(lambda: job.send("a")) == 1
    worker = make_worker(broker, threads=1)
    try:
        assert broker.middleware.index(middleware_of(broker)) < broker.middleware.index(
            next(m for m in broker.middleware if isinstance(m, Retries)))
        assert trips.of(lambda: job.send("b")) == 1
    finally:
        worker.stop()


# Duplicates and concurrency ---------------------------------------------------


@pytest.mark.parametrize("on_conflict", ["raise", "log"])
def test_a_duplicate_is_refused_in_one_round_trip_and_nothing_is_enqueued(
    redis_url, redis_client, namespace, brokers, trips, on_conflict
):
    # Given a queued message holding its key, behind a middleware with enqueue hooks, and Results
    hooks, results = Hooks(), ResultsStub()
    broker = new_broker(redis_url, namespace, Results(backend=results), hooks)
    brokers.append(broker)
    events = events_of(broker)
    job = job_of(broker, on_conflict=on_conflict, store_results=True)
    first = job.send("k")
    # When a duplicate is sent
    outcome: list[Any] = []

    def send() -> None:
        try:
            outcome.append(job.send("k"))
        except DuplicateMessage as e:
            outcome.append(e)

    assert trips.of(send) == 1
    # Then it is refused as on the two-step path
    [refused] = outcome
    if on_conflict == "raise":
        assert isinstance(refused, DuplicateMessage) and refused.holder == first.message_id
    else:
        assert refused.options["unique_duplicate_of"] == first.message_id
        with pytest.raises(ResultFailure) as failure:
            refused.get_result(backend=results)
        assert failure.value.orig_exc_type == "DuplicateMessage"
    duplicates = [e for e in events if e[0] == "duplicate"]
    assert len(duplicates) == 1 and duplicates[0][2] == first.message_id
    assert [m["message_id"] for m in stored(redis_client, namespace, "default")] == [first.message_id]
    assert not [s for s in hooks.seen if s[0] == "after" and s[1] != first.message_id]


def test_many_threads_sending_one_key_enqueue_it_once(redis_url, redis_client, namespace, brokers):
    # Given the fast path
    broker = new_broker(redis_url, namespace)
    brokers.append(broker)
    job = job_of(broker)
    # When 8 threads send the same key 20 times each, the first sends of
    # all eight at once (the send script is registered by the first)
    results: list[Any] = []
    errors: list[Exception] = []

    def send() -> None:
        try:
            for _ in range(20):
                results.append(job.send("k"))
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=send) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # Then no send failed, exactly one was enqueued and every other send names it
    assert errors == []
    [queued] = stored(redis_client, namespace, "default")
    accepted = [m for m in results if "unique_duplicate_of" not in m.options]
    assert [m.message_id for m in accepted] == [queued["message_id"]]
    assert {m.options["unique_duplicate_of"] for m in results if m not in accepted} == {queued["message_id"]}


def test_a_flushed_script_cache_reloads_the_send_script(redis_url, redis_client, namespace, brokers, trips):
    # Given a send script that Redis forgot (a restart, a SCRIPT FLUSH)
    broker = new_broker(redis_url, namespace)
    brokers.append(broker)
    job = job_of(broker)
    job.send("warm-up")
    redis_client.script_flush()
    # When a message is sent
    sent: list[Any] = []
    assert trips.of(lambda: sent.append(job.send("k"))) == 2  # NOSCRIPT, then the load and the call again
    # Then it is enqueued once, holding its lock, and the next send is one round trip again
    assert [m["message_id"] for m in stored(redis_client, namespace, "default")][-1] == sent[0].message_id
    assert lock_of(redis_client, namespace, sent[0].message_id) is not None
    assert trips.of(lambda: job.send("other")) == 1


# Failures ---------------------------------------------------------------------


def test_a_failing_dispatch_raises_the_brokers_error_and_leaves_no_lock(redis_url, redis_client, namespace, brokers):
    # Given a queue whose messages hash is not a hash: Dramatiq's dispatch.lua fails on it
    broker = new_broker(redis_url, namespace)
    brokers.append(broker)
    events = events_of(broker)
    job = job_of(broker)
    job.send("warm-up")
    del events[:]
    redis_client.delete(*enqueue_locks(redis_client, namespace))
    redis_client.delete(f"{namespace}:default", f"{namespace}:default.msgs")
    redis_client.set(f"{namespace}:default.msgs", "not a hash")
    # When a message is sent
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        job.send("k")
    # Then nothing was enqueued and no lock is left, and once the queue is repaired the key sends
    assert not enqueue_locks(redis_client, namespace)
    assert not redis_client.exists(f"{namespace}:default")
    assert not [e for e in events if e[0] == "locked"]
    redis_client.delete(f"{namespace}:default.msgs")
    sent = job.send("k")
    assert [m["message_id"] for m in stored(redis_client, namespace, "default")] == [sent.message_id]


@pytest.mark.parametrize("on_backend_error", ["fail", "run_unlocked"])
def test_a_lock_that_cannot_be_taken_fails_closed_or_goes_on_unlocked(
    redis_url, redis_client, namespace, brokers, on_backend_error
):
    # Given a lock key that is not a lock: acquire.lua fails on it, inside the send script
    broker = new_broker(redis_url, namespace, on_backend_error=on_backend_error)
    brokers.append(broker)
    events = events_of(broker)
    job = job_of(broker)
    job.send("k")
    [key] = enqueue_locks(redis_client, namespace)
    redis_client.delete(f"{namespace}:default", f"{namespace}:default.msgs")
    redis_client.set(key, "not a lock")
    # When the key is sent again
    if on_backend_error == "fail":
        with pytest.raises(LockBackendError):
            job.send("k")
        # Then nothing is enqueued and the key is left as it was
        assert stored(redis_client, namespace, "default") == []
    else:
        sent = job.send("k")
        # Then it is enqueued without its lock
        assert [m["message_id"] for m in stored(redis_client, namespace, "default")] == [sent.message_id]
    assert redis_client.get(key) == b"not a lock"
    assert [e[0] for e in events].count("backend_error") == 1


@pytest.mark.parametrize("on_backend_error", ["fail", "run_unlocked"])
def test_a_lost_reply_raises_and_keeps_the_lock_of_the_message_that_went_out(
    redis_url, redis_client, namespace, brokers, monkeypatch, on_backend_error
):
    # Given a Redis whose reply to the send script is lost, and stays unreachable after
    from dramatiq_unique.backends.redis import calls

    broker = new_broker(redis_url, namespace, on_backend_error=on_backend_error)
    brokers.append(broker)
    events = events_of(broker)
    job = job_of(broker, on_conflict="raise")
    job.send("warm-up")
    redis_client.delete(*enqueue_locks(redis_client, namespace))
    exchange, answered = calls.ScriptCalls._exchange, []

    def lost(self: Any, conn: Any, commands: list[Any]) -> list[Any]:
        sends = {sha for name, sha in self.shas.items() if name.startswith("send:")}
        if commands[0][1] not in sends:
            return exchange(self, conn, commands)
        if not answered:  # the first one goes through; its reply, and every resend, are lost
            answered.append(exchange(self, conn, commands))
        raise redis.TimeoutError("Timeout reading from socket")

    monkeypatch.setattr(calls.ScriptCalls, "_exchange", lost)
    del events[:]
    # When a message is sent
    expected = LockBackendError if on_backend_error == "fail" else redis.TimeoutError
    with pytest.raises(expected):
        job.send("k")
    # Then the send fails, but the message went out (its call ran, only the reply was
    # lost) and keeps the lock the same script took for it
    assert answered and [e[0] for e in events] == ["backend_error"]
    [went_out] = [m for m in stored(redis_client, namespace, "default") if m["args"] == ["k"]]
    assert lock_of(redis_client, namespace, went_out["message_id"]).holders.keys() == {went_out["message_id"]}
    # And a send again, once Redis answers, is refused as the duplicate it is
    monkeypatch.setattr(calls.ScriptCalls, "_exchange", exchange)
    with pytest.raises(DuplicateMessage) as refused:
        job.send("k")
    assert refused.value.holder == went_out["message_id"]
    assert len(stored(redis_client, namespace, "default")) == 2


def test_a_resent_call_enqueues_once(redis_client, namespace):
    # Given the send script, as a client resends it after a lost reply
    backend = RedisBackend(client=redis_client)
    broker = RedisBroker(client=redis_client, namespace=namespace)
    source = dispatch_source(broker)
    assert source is not None
    redis_id, owner, key = str(uuid.uuid4()), str(uuid.uuid4()), f"{namespace}:job:{{d}}:queue"
    arguments = ["enqueue", int(time.time() * 1000), "default", broker.broker_id, 60_000, 86_400_000, 0, 1000,
                 redis_id, b'{"message_id": "m"}']

    def send() -> Any:
        return backend.acquire_and_dispatch(key, owner, ttl=60_000, limit=1, lock="until_executed", lock_args=None,
                                            where="here", dispatch=source, namespace=namespace, arguments=arguments)

    # When it runs twice
    first, again = send(), send()
    # Then the message is enqueued once and both say the lock was taken by this send
    assert redis_client.lrange(f"{namespace}:default", 0, -1) == [redis_id.encode()]
    assert first.acquired and again.acquired and not first.reentered and not again.reentered
    assert (backend.inspect(key) or pytest.fail("no lock")).holders.keys() == {owner}


# Re-enqueues never take the fast path -----------------------------------------


def test_a_retry_whose_lock_was_taken_by_another_message_is_still_enqueued(
    redis_url, redis_client, namespace, brokers
):
    # Given a message whose lock is lost and taken by a new message while it runs, and that then fails once
    broker = new_broker(redis_url, namespace)
    brokers.append(broker)
    events = events_of(broker)
    runs: list[tuple[str, int]] = []

    def flaky(key: str, sent_as: str) -> None:
        message = CurrentMessage.get_current_message()
        runs.append((sent_as, message.options.get("retries", 0)))
        if sent_as == "first" and not message.options.get("retries"):
            redis_client.delete(*enqueue_locks(redis_client, namespace))
            assert "unique_duplicate_of" not in job.send("k", "second").options
            raise RuntimeError("fails once")

    broker.add_middleware(CurrentMessage())
    job = dramatiq.actor(flaky, broker=broker, lock="until_executed", lock_args=["key"], max_retries=1,
                         min_backoff=10, max_backoff=10)
    first = job.send("k", "first")
    # When a worker runs it: the retry is re-enqueued from the worker, then moved from the delay queue
    worker = make_worker(broker, threads=1)
    try:
        wait_for(lambda: len(runs) == 3, what="three runs")
    finally:
        worker.stop()
    # Then the retry went on although another message held the key, and every run happened
    assert sorted(runs) == [("first", 0), ("first", 1), ("second", 0)]
    assert ("lock_lost", first.message_id) in [(e[0], e[1]) for e in events]


# Where the fast path stands aside -----------------------------------------------


class Subclass(RedisBroker):
    pass


class LaterHook(dramatiq.Middleware):
    def __init__(self) -> None:
        self.seen: list[str] = []

    def before_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
        self.seen.append(message.message_id)


def _unknown_dispatch(broker: Any) -> None:
    script = broker.scripts["dispatch"]
    changed = script.script + (b"\n-- changed\n" if isinstance(script.script, bytes) else "\n-- changed\n")
    broker.scripts["dispatch"] = broker.client.register_script(changed)


@pytest.mark.parametrize("case", ["subclass", "unknown dispatch", "later before_enqueue", "other database",
                                  "replacing actor"])
def test_where_the_fast_path_cannot_be_exact_a_send_takes_two_round_trips(
    redis_url, redis_client, namespace, brokers, trips, case
):
    # Given a configuration the fast path does not serve
    later = LaterHook()
    broker = RedisBroker(url=redis_url, namespace=namespace) if case != "subclass" else Subclass(
        url=redis_url, namespace=namespace)
    brokers.append(broker)
    if case == "unknown dispatch":
        _unknown_dispatch(broker)
    other = None
    if case == "other database":
        other = RedisBackend(url=redis_url.rsplit("/", 1)[0] + "/12")
    backend = RedisBackend(client=broker.client) if case == "subclass" else other
    broker.add_middleware(UniqueMiddleware(prefix=namespace, backend=backend))
    if case == "later before_enqueue":
        broker.add_middleware(later)
    job = job_of(broker, on_conflict="replace" if case == "replacing actor" else "log")
    job.send("warm-up")
    # When a message and its duplicate are sent
    sent: list[Any] = []
    assert trips.of(lambda: sent.append(job.send("k"))) == 2
    duplicate = job.send("k")
    # Then the lock was taken apart from the enqueue, and the outcome is the two-step path's
    queued = [m["message_id"] for m in stored(redis_client, namespace, "default")]
    if case == "replacing actor":
        assert queued[-2:] == [sent[0].message_id, duplicate.message_id]
    else:
        assert duplicate.options["unique_duplicate_of"] == sent[0].message_id
        assert queued[-1] == sent[0].message_id
    if case == "later before_enqueue":
        assert duplicate.message_id not in later.seen  # refused before it got there
    if other is not None:
        other.client.delete(*other.client.keys(f"{namespace}:*"))
    assert (dispatch_source(broker) is None) == (case in ("subclass", "unknown dispatch"))


def test_a_do_enqueue_replaced_by_someone_else_is_left_alone(redis_url, redis_client, namespace, brokers, trips):
    # Given a Redis broker whose do_enqueue was wrapped before the middleware came
    broker = RedisBroker(url=redis_url, namespace=namespace)
    brokers.append(broker)
    plain, published = broker._dispatch("enqueue"), []

    def do_enqueue(queue_name: str, redis_message_id: str, data: bytes) -> Any:
        published.append(redis_message_id)
        return plain(queue_name, redis_message_id, data)

    broker.do_enqueue = do_enqueue  # type: ignore[attr-defined]
    broker.add_middleware(UniqueMiddleware(prefix=namespace))
    job = job_of(broker)
    job.send("warm-up")
    # Then every send goes through that wrapper, after its lock was taken
    assert trips.of(lambda: job.send("k")) == 2
    assert len(published) == 2
