"""The worker path's shared round trips, on a real Redis: concurrent
run lock calls grouped into one round trip, and pending releases
carried in front of the next run lock call.
"""

from __future__ import annotations

import ctypes
import hashlib
import sys
import threading
import time
from typing import Any, Callable, Optional

import pytest
import redis

from dramatiq_unique.backends.records import Copy, Release
from dramatiq_unique.background import now_ms, stop_calls_by
from dramatiq_unique.backends.redis.calls import ScriptCalls, _pack, _pack_in_python
from dramatiq_unique.backends.redis.calls import GroupCommit
from dramatiq_unique.backends.redis import RedisBackend
from dramatiq_unique.worker.leases import HandOff
from dramatiq_unique.worker.release import PendingRelease, Releaser

from .conftest import wait_for
from .test_releaser import Outcomes, pending
from .faults.proxy import Proxy, through

ECHO = {"echo": "return ARGV[1]"}


class GatedRoundTrips:
    """Real round trips through ``ScriptCalls``, recorded, the first
    one held until ``gate`` is set.
    """

    def __init__(self, client: redis.Redis) -> None:
        self.calls = ScriptCalls(client, ECHO)
        self.calls.batch([("echo", [], ["warm"])])  # loads the script
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.sent: list[list[str]] = []

    def __call__(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        self.entered.set()
        self.gate.wait(10)
        self.sent.append([command[-1] for command in commands])
        return self.calls._round_trip(commands)


def echo(value: str) -> tuple[Any, ...]:
    return (b"EVALSHA", hashlib.sha1(ECHO["echo"].encode()).hexdigest().encode(), 0, value)


def in_thread(target: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = target()
        except BaseException as e:  # noqa: B902 - the test inspects what the thread raised
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def queued(group: GroupCommit, n: int) -> None:
    wait_for(lambda: len(group._queue) == n, what=f"{n} queued caller(s)")


def two_queued_behind_one(group: GroupCommit, trips: GatedRoundTrips, second: str, third: str) -> list[Any]:
    """A caller of "a" whose round trip is in flight (held by ``trips``),
    then callers of ``second`` and ``third`` queued behind it, in that
    order: each as ``(thread, outcome)``.
    """
    callers = [in_thread(lambda: group.call([echo("a")]))]
    assert trips.entered.wait(5)
    for value in (second, third):
        callers.append(in_thread(lambda value=value: group.call([echo(value)])))
        queued(group, len(callers) - 1)
    return callers


def test_commands_are_packed_as_redis_reads_them_with_or_without_hiredis():
    # str in UTF-8, int in decimal, bytes as they are: the only kinds the scripts take
    command = (b"EVALSHA", b"ab", 2, "k:{\u00e9}", "x", 60000, b"\x00raw")
    expected = (b"*7\r\n$7\r\nEVALSHA\r\n$2\r\nab\r\n$1\r\n2\r\n$6\r\nk:{\xc3\xa9}\r\n$1\r\nx\r\n"
                b"$5\r\n60000\r\n$4\r\n\x00raw\r\n")
    assert _pack_in_python(command) == expected
    assert _pack(command) == expected  # hiredis's packer where installed (the full CI leg), else the same function


def test_callers_that_arrive_during_a_round_trip_share_the_next_one(redis_client):
    # Given a round trip in flight, led by the first caller
    trips = GatedRoundTrips(redis_client)
    group = GroupCommit(trips)
    leader, led = in_thread(lambda: group.call([echo("first")]))
    assert trips.entered.wait(5)
    # When seven more callers arrive meanwhile
    callers = [in_thread(lambda i=i: group.call([echo(f"c{i}"), echo(f"c{i}+")])) for i in range(7)]
    queued(group, 7)
    trips.gate.set()
    for thread, _ in [(leader, led), *callers]:
        thread.join(5)
    # Then they went out together in one more round trip, each caller got its own replies
    assert len(trips.sent) == 2 and trips.sent[0] == ["first"]
    assert sorted(trips.sent[1]) == sorted(v for i in range(7) for v in (f"c{i}", f"c{i}+"))
    assert led["value"] == [b"first"]
    assert [outcome["value"] for _, outcome in callers] == [[f"c{i}".encode(), f"c{i}+".encode()] for i in range(7)]
    # And the next caller, alone, leads at once
    assert group.call([echo("alone")]) == [b"alone"] and not group._leading


def test_a_failed_round_trip_fails_every_caller_in_it_and_the_next_one_still_goes(redis_client):
    # Given a round trip in flight and two callers queued behind it
    trips = GatedRoundTrips(redis_client)
    failing = {"next": False}

    def round_trip(commands: list[tuple[Any, ...]]) -> list[Any]:
        replies = trips(commands)
        if failing["next"]:
            raise redis.ConnectionError("lost")
        failing["next"] = True
        return replies

    group = GroupCommit(round_trip)
    first, first_outcome = in_thread(lambda: group.call([echo("a")]))
    assert trips.entered.wait(5)
    behind = [in_thread(lambda v=v: group.call([echo(v)])) for v in ("b", "c")]
    queued(group, 2)
    # When the round trip that carries them fails
    trips.gate.set()
    for thread, _ in [(first, first_outcome), *behind]:
        thread.join(5)
    # Then each of its callers hears of it, and the group is free again
    assert first_outcome["value"] == [b"a"]
    assert all(isinstance(outcome.get("error"), redis.ConnectionError) for _, outcome in behind)
    failing["next"] = False
    assert group.call([echo("d")]) == [b"d"]


def test_a_caller_that_times_out_while_queued_sends_nothing_and_the_next_one_leads(redis_client):
    # Given a round trip in flight, a caller that waits 0.2 s and one that waits long
    trips = GatedRoundTrips(redis_client)
    group = GroupCommit(trips, timeout=0.2)
    first, _ = in_thread(lambda: group.call([echo("a")]))
    assert trips.entered.wait(5)
    impatient, impatient_outcome = in_thread(lambda: group.call([echo("impatient")]))
    impatient.join(5)
    group.timeout = 10
    patient, patient_outcome = in_thread(lambda: group.call([echo("patient")]))
    queued(group, 1)
    # When the round trip in flight returns
    trips.gate.set()
    patient.join(5)
    first.join(5)
    # Then the impatient caller timed out and was never sent; the patient one led the next round trip
    assert isinstance(impatient_outcome["error"], TimeoutError)
    assert patient_outcome["value"] == [b"patient"]
    assert ["impatient"] not in trips.sent and trips.sent[-1] == ["patient"]


def async_raise(thread: threading.Thread, error: type[BaseException]) -> None:
    """What Dramatiq's TimeLimit does to a worker thread."""
    assert thread.ident is not None
    done = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(error))
    assert done == 1


class Interrupted(Exception):
    pass


def test_a_caller_interrupted_as_it_is_handed_the_lead_passes_it_on(redis_client):
    # Given a round trip in flight and two callers queued behind it, the first to be handed the lead
    trips = GatedRoundTrips(redis_client)
    group = GroupCommit(trips)
    (first, _), (doomed, doomed_outcome), (following, following_outcome) = two_queued_behind_one(
        group, trips, "doomed", "following"
    )
    # When the first is interrupted (a time limit) just as it wakes to lead
    async_raise(doomed, Interrupted)
    trips.gate.set()
    for thread in (first, doomed, following):
        thread.join(5)
    # Then it raised, sent nothing, and the other caller led instead: nobody waits for a lead that never comes
    assert isinstance(doomed_outcome["error"], Interrupted)
    assert following_outcome["value"] == [b"following"]
    assert all("doomed" not in sent for sent in trips.sent)
    assert not group._leading


class Interrupt(BaseException):
    """As Dramatiq's TimeLimitExceeded and Shutdown: not an Exception."""


def test_an_interrupt_that_breaks_a_round_trip_is_raised_in_its_own_thread_only(redis_client):
    # Given a round trip in flight and two callers queued behind it; the first of them leads the next one
    trips = GatedRoundTrips(redis_client)
    broken: list[list[Any]] = []

    def round_trip(commands: list[tuple[Any, ...]]) -> list[Any]:
        replies = trips(commands)
        if len(trips.sent) == 2:  # the second round trip: its leader's time limit fires in the middle of it
            broken.append(replies)
            raise Interrupt()
        return replies

    group = GroupCommit(round_trip)
    (first, first_outcome), (leader, leader_outcome), (follower, follower_outcome) = two_queued_behind_one(
        group, trips, "b", "c"
    )
    # When the interrupt breaks the round trip that carries both
    trips.gate.set()
    for thread in (first, leader, follower):
        thread.join(5)
    # Then the thread it was meant for raises it, and the other caller gets a lost reply, not a stranger's interrupt
    assert first_outcome["value"] == [b"a"] and trips.sent[1] == ["b", "c"] and broken
    assert isinstance(leader_outcome["error"], Interrupt)
    assert type(follower_outcome["error"]) is TimeoutError and "may have applied" in str(follower_outcome["error"])
    assert group.call([echo("d")]) == [b"d"] and not group._leading


# Releases carried by the next run lock call ---------------------------


def start_options(key: str, message_id: str) -> dict[str, Any]:
    return {"ttl": 60_000, "limit": 1, "lock": "while_executing", "copy": Copy(key, message_id, 0, "")}


class CountingBackend(RedisBackend):
    """Counts round trips; can fail the next start."""

    def __init__(self, client: redis.Redis) -> None:
        super().__init__(client=client)
        self.trips: list[str] = []
        self.fail_next: Optional[Exception] = None
        assert self.calls is not None
        round_trip = self.calls._round_trip

        def counted(commands: list[tuple[Any, ...]]) -> list[Any]:
            self.trips.append("+".join(sorted({self._name(command) for command in commands})))
            if self.fail_next is not None:
                error, self.fail_next = self.fail_next, None
                raise error
            return round_trip(commands)

        self.calls._round_trip = counted  # type: ignore[method-assign]
        self.calls._group = GroupCommit(counted)

    def _name(self, command: tuple[Any, ...]) -> str:
        assert self.calls is not None
        return next((name for name, sha in self.calls.shas.items() if sha == command[1]), str(command[0]))


@pytest.fixture
def counting(redis_client: redis.Redis) -> CountingBackend:
    backend = CountingBackend(redis_client)
    backend.acquire("warm:{w}:run", "w/0", ttl=1000)  # loads the scripts
    backend.release_and_start([("warm:{w}:run", "w/0")], "warm:{v}:run", "v/0", **start_options("warm:{v}:run", "v"))
    backend.trips.clear()
    return backend


def test_a_pending_release_rides_in_front_of_the_next_start_and_frees_its_key_first(counting, redis_client):
    # Given a job that ended holding key k, its release pending
    counting.acquire("t:{k}:run", "a/0", ttl=60_000)
    outcomes = Outcomes()
    releaser = Releaser(counting, on_stalled=lambda batch: None, linger=10_000, reports=outcomes)
    releaser.submit(pending("t:{k}:run", "a/0"))
    counting.trips.clear()
    # When another worker thread starts the next job of the same key
    started = releaser.take_run_lock("t:{k}:run", "b/0", **start_options("t:{k}:run", "b"))
    # Then one round trip released k and took it for the new job, and the release was reported
    assert counting.trips == ["release+start"]
    assert started.acquisition.acquired
    assert [type(o) for o in outcomes] == [Release] and outcomes[0].held
    holders = redis_client.hkeys("t:{k}:run")
    assert b"b/0" in holders and b"a/0" not in holders
    assert releaser.pending() == 0
    releaser.stop()


def test_a_release_that_no_start_carries_is_sent_by_the_releaser_thread(counting, redis_client):
    # Given a release submitted while no job starts
    counting.acquire("t:{k}:run", "a/0", ttl=60_000)
    outcomes = Outcomes()
    releaser = Releaser(counting, on_stalled=lambda batch: None, linger=50, reports=outcomes)
    counting.trips.clear()
    releaser.submit(pending("t:{k}:run", "a/0"))
    # Then the releaser thread sends it on its own, once
    wait_for(lambda: len(outcomes) == 1, what="the release")
    assert counting.trips == ["release"] and not redis_client.exists("t:{k}:run")
    releaser.stop()


def test_releases_carried_by_a_failing_start_are_reported_failed_not_lost(counting, redis_client):
    # Given two pending releases
    for key in ("t:{a}:run", "t:{b}:run"):
        counting.acquire(key, "x/0", ttl=60_000)
    outcomes = Outcomes()
    releaser = Releaser(counting, on_stalled=lambda batch: None, linger=10_000, reports=outcomes)
    for key in ("t:{a}:run", "t:{b}:run"):
        releaser.submit(pending(key, "x/0"))
    counting.trips.clear()
    # When the start that carries them fails
    counting.fail_next = redis.ConnectionError("lost")
    with pytest.raises(redis.ConnectionError):
        releaser.take_run_lock("t:{k}:run", "b/0", **start_options("t:{k}:run", "b"))
    # Then each release reports that failure (the keys expire with their leases), none was sent twice
    assert [type(o) for o in outcomes] == [redis.ConnectionError] * 2
    assert releaser.pending() == 0 and counting.trips == ["release+start"]
    assert redis_client.exists("t:{a}:run", "t:{b}:run") == 2
    releaser.stop()


def test_releases_carried_by_a_start_that_an_interrupt_breaks_are_sent_again_and_not_reported_lost(
    counting, redis_client
):
    # Given two pending releases, one of them of a key a waiter waits for
    for key in ("t:{a}:run", "t:{b}:run"):
        counting.acquire(key, "x/0", ttl=60_000)
    waiter = Copy("t:{b}:run", "w", 1, "handoff")
    counting.join_line(waiter, b"handed over", order=1, ttl=60_000)
    outcomes = Outcomes()
    releaser = Releaser(counting, on_stalled=lambda batch: None, linger=10_000, reports=outcomes)
    for key in ("t:{a}:run", "t:{b}:run"):
        releaser.submit(pending(key, "x/0"))
    counting.trips.clear()
    # When the start that carries them is broken by its worker thread's interrupt after Redis applied it
    original = counting.release_and_start

    def applied_then_interrupted(*args: Any, **kwargs: Any) -> Any:
        original(*args, **kwargs)
        raise Interrupt()

    counting.release_and_start = applied_then_interrupted  # type: ignore[method-assign]
    with pytest.raises(Interrupt):
        releaser.take_run_lock("t:{k}:run", "b/0", **start_options("t:{k}:run", "b"))
    # Then the releaser thread sends both again at once, though releases linger 10 s here
    wait_for(lambda: releaser.pending() == 0, timeout=5, what="the releases sent again")
    assert counting.trips == ["release+start", "release"]
    # And, found released already, neither is reported, as lost or otherwise
    assert outcomes == [] and not redis_client.exists("t:{a}:run")
    # (b's slot is reserved for its waiter now: no holder is left)
    held = counting.inspect("t:{b}:run")
    assert held is None or not held.holders
    assert releaser.pending() == 0
    releaser.stop()


def test_a_drain_sends_lingering_releases_at_once(counting, redis_client):
    counting.acquire("t:{k}:run", "a/0", ttl=60_000)
    outcomes = Outcomes()
    releaser = Releaser(counting, on_stalled=lambda batch: None, linger=60_000, reports=outcomes)
    releaser.submit(pending("t:{k}:run", "a/0"))
    assert releaser.drain(5_000)
    assert len(outcomes) == 1 and not redis_client.exists("t:{k}:run")
    releaser.stop()


def test_a_releaser_that_does_not_linger_sends_each_release_at_once_without_spinning(counting, redis_client):
    # Given a releaser told not to wait for worker threads
    keys = [f"t:{{{i}}}:run" for i in range(30)]
    for key in keys:
        counting.acquire(key, "a/0", ttl=60_000)
    outcomes = Outcomes()
    releaser = Releaser(counting, on_stalled=lambda batch: None, linger=0, reports=outcomes)
    counting.trips.clear()
    # When a job ends every 10 ms for 0.3 s (the load, not a condition)
    cpu = time.process_time()
    for key in keys:
        releaser.submit(pending(key, "a/0"))
        time.sleep(0.01)
    # Then each release went out on its own, and the releaser burned no CPU in between
    assert releaser.drain(5_000) and len(outcomes) == 30
    assert time.process_time() - cpu < 0.15
    assert not any(redis_client.exists(key) for key in keys)
    releaser.stop()


def test_a_carried_release_is_reported_before_the_start_returns_and_its_hand_off_runs_off_the_worker(
    counting, redis_client
):
    # Given a held key with a waiter, and the holder's release pending
    counting.acquire("t:{k}:run", "a/0", ttl=60_000)
    counting.join_line(Copy("t:{k}:run", "w", 1, "handoff"), b"body of w", order=1, ttl=60_000)
    story: list[tuple[str, str]] = []
    handed = threading.Event()

    class Story:
        def released(self, pending: PendingRelease, outcome: Any) -> HandOff:
            story.append(("released", threading.current_thread().name))
            return HandOff(None, pending.key, outcome.promoted)  # type: ignore[arg-type]

        def hand_over(self, handoff: HandOff) -> None:
            story.append((f"handed {handoff.encoded.decode()}", threading.current_thread().name))
            handed.set()

    releaser = Releaser(counting, on_stalled=lambda batch: None, linger=10_000, reports=Story())
    releaser.submit(PendingRelease("t:{k}:run", "a/0", "actor"))
    # When another job's start carries it
    releaser.take_run_lock("t:{o}:run", "b/0", **start_options("t:{o}:run", "b"))
    story.append(("started", threading.current_thread().name))
    # Then the release was reported first, on this thread, and the hand-off ran on the releaser thread
    assert handed.wait(5)
    me = threading.current_thread().name
    assert story[:2] == [("released", me), ("started", me)]
    assert story[2] == ("handed body of w", "dramatiq-unique-releaser")
    assert releaser.drain(5_000)
    releaser.stop()


def test_a_script_added_beside_concurrent_callers_is_callable_once_they_see_it():
    # Given script calls (no connection is made) and a thread switch after
    # nearly every bytecode, so that a reader runs between add()'s steps
    calls = ScriptCalls(redis.Redis(port=1), {"first": "return 1"})
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    missed: list[str] = []
    try:
        for i in range(300):
            name = f"script-{i}"

            def reader(name: str = name) -> None:
                # As RedisBackend.acquire_and_dispatch does: look for the
                # name in the sources, then call the script by its SHA1.
                while name not in calls.sources:
                    pass
                if name not in calls.shas:
                    missed.append(name)

            thread = threading.Thread(target=reader)
            thread.start()
            calls.add(name, f"return {i}" * 50)
            thread.join()
    finally:
        sys.setswitchinterval(switch)
    # Then no reader found a name it could not call
    assert missed == []


# A worker's shutdown: no wait for a lock call outlasts its deadline ---------------------


def test_a_queued_caller_stops_waiting_at_the_shutdown_deadline(redis_client):
    # Given a round trip in flight that never returns, and a caller queued behind it for 30 s
    trips = GatedRoundTrips(redis_client)
    group = GroupCommit(trips, timeout=30)
    first, _ = in_thread(lambda: group.call([echo("a")]))
    assert trips.entered.wait(5)
    follower, outcome = in_thread(lambda: group.call([echo("follower")]))
    queued(group, 1)
    # When the worker's shutdown sets a deadline for lock calls 200 ms from now
    started = time.monotonic()
    stop_calls_by(now_ms() + 200)
    try:
        follower.join(5)
        # Then the follower stops waiting then, as a lost reply does, and was never sent
        assert 0.15 <= time.monotonic() - started < 1.0
        assert isinstance(outcome["error"], TimeoutError)
    finally:
        stop_calls_by(None)
        trips.gate.set()
        first.join(5)
    assert ["follower"] not in trips.sent


def test_a_round_trip_stuck_past_the_shutdown_deadline_is_broken_and_not_sent_again(redis_url):
    # Given a lock call on a client with no socket timeout, into a network that went silent
    port = redis.Redis.from_url(redis_url).connection_pool.connection_kwargs["port"]
    with Proxy(port) as proxy:
        calls = ScriptCalls(redis.Redis.from_url(through(proxy, redis_url)), {"one": "return 1"})
        assert calls.call("one", [], []) == 1
        proxy.blackhole()
        call, outcome = in_thread(lambda: calls.call("one", [], []))
        time.sleep(0.3)
        assert call.is_alive()
        # When the shutdown's deadline for lock calls passes
        started = time.monotonic()
        stop_calls_by(now_ms() + 100, stuck_after=100)
        try:
            call.join(5)
            # Then the call fails soon after, as a timeout (it may have applied), and is not sent again
            assert not call.is_alive() and time.monotonic() - started < 1.5
            assert isinstance(outcome["error"], redis.TimeoutError)
        finally:
            stop_calls_by(None)
        # And once the shutdown is over and the network is back, calls go through again
        proxy.heal()
        assert calls.call("one", [], []) == 1
