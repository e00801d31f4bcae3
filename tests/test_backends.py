"""The backend contract, run against every backend."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from dramatiq_unique.backends.base import LockBackend, LockReads
from dramatiq_unique.backends.capabilities import SendsWithPublish
from dramatiq_unique.backends.records import (
    DUPLICATE_WINDOW,
    Copy,
    CopyVerdict,
    CurrentCheck,
    CurrentStatus,
    Release,
    ReplaceStatus,
    Start,
)
from dramatiq_unique.backends.redis import RedisBackend

KEY = "test:actor:{abc}:run"


def test_acquire_then_refuse_another_owner(backend):
    # Given a key held by one owner
    first = backend.acquire(KEY, "a", ttl=10_000)
    # When another owner tries
    second = backend.acquire(KEY, "b", ttl=10_000)
    # Then the first holds it and the second learns who does
    assert first.acquired and not first.reentered
    assert not second.acquired and second.holder == "a"


def test_acquire_is_reentrant_for_the_same_owner(backend):
    backend.acquire(KEY, "a", ttl=10_000)
    again = backend.acquire(KEY, "a", ttl=10_000)
    assert again.acquired and again.reentered


def test_release_checks_the_owner(backend):
    backend.acquire(KEY, "a", ttl=10_000)
    assert not backend.release(KEY, "b").held
    assert not backend.acquire(KEY, "b", ttl=10_000).acquired
    assert backend.release(KEY, "a").held
    assert not backend.release(KEY, "a").held
    assert backend.acquire(KEY, "b", ttl=10_000).acquired


def test_a_lock_expires(backend):
    backend.acquire(KEY, "a", ttl=100)
    time.sleep(0.15)
    assert backend.acquire(KEY, "b", ttl=10_000).acquired
    assert not backend.release(KEY, "a").held


def test_extend_keeps_a_lease_alive_and_refuses_strangers(backend):
    backend.acquire(KEY, "a", ttl=300)
    for _ in range(4):
        time.sleep(0.1)
        assert backend.extend([(KEY, "a"), (KEY, "b")], 300) == [True, False]
    assert not backend.acquire(KEY, "b", ttl=1000).acquired


def test_a_lapsed_lease_cannot_be_extended_or_released_after_takeover(backend):
    # Given a holder whose lease ran out and a new holder
    backend.acquire(KEY, "old", ttl=100)
    time.sleep(0.15)
    assert backend.acquire(KEY, "new", ttl=10_000).acquired
    # Then the stale holder can neither extend nor release it
    assert backend.extend([(KEY, "old")], 10_000) == [False]
    assert not backend.release(KEY, "old").held
    assert backend.inspect(KEY).holders.keys() == {"new"}


def test_limit_admits_n_holders_each_with_its_own_deadline(backend):
    assert backend.acquire(KEY, "a", ttl=100, limit=3).acquired
    assert backend.acquire(KEY, "b", ttl=10_000, limit=3).acquired
    assert backend.acquire(KEY, "c", ttl=10_000, limit=3).acquired
    assert not backend.acquire(KEY, "d", ttl=10_000, limit=3).acquired
    time.sleep(0.15)
    # only the dead holder's slot comes back
    assert backend.acquire(KEY, "d", ttl=10_000, limit=3).acquired
    assert not backend.acquire(KEY, "e", ttl=10_000, limit=3).acquired


def test_fence_tokens_grow_with_every_new_holder(backend):
    tokens = []
    for owner in "abcde":
        tokens.append(backend.acquire(KEY, owner, ttl=10_000).fence)
        backend.release(KEY, owner)
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)
    assert backend.acquire(KEY, "x", ttl=10_000).fence > tokens[-1]


def test_inspect_and_scan(backend):
    backend.acquire(KEY, "a", ttl=10_000, lock="while_executing", lock_args='{"x":1}')
    backend.acquire("test:other:{def}:queue", "b", ttl=10_000)
    info = backend.inspect(KEY)
    assert info.lock == "while_executing" and info.lock_args == '{"x":1}'
    assert set(info.holders) == {"a"} and info.holders["a"] > time.time() * 1000
    assert list(backend.scan("test:actor:*")) == [KEY]
    assert backend.inspect("test:none:{x}:run") is None
    assert backend.delete(KEY) and backend.inspect(KEY) is None


def test_scan_reads_one_glob_on_every_backend(backend):
    # The glob of Redis's SCAN MATCH: ? one character, [^...] none of a set, \\ a plain character
    keys = ["g:a*b:{1}:run", "g:axb:{2}:run", "g:ab:{3}:queue", "g:a?b:{4}:run"]
    for key in keys:
        backend.acquire(key, "o", ttl=10_000)
    held = lambda pattern: sorted(backend.scan(pattern))  # noqa: E731
    assert held("g:*") == sorted(keys)
    assert held("g:a?b:*") == ["g:a*b:{1}:run", "g:a?b:{4}:run", "g:axb:{2}:run"]
    assert held("g:a\\*b:*") == ["g:a*b:{1}:run"]
    assert held("g:a[^x]b:*:run") == ["g:a*b:{1}:run", "g:a?b:{4}:run"]
    assert held("g:a[x]b:*") == ["g:axb:{2}:run"]
    assert held("g:*:queue") == ["g:ab:{3}:queue"]


def test_delete_prefix_drops_a_prefix_and_what_it_keeps_beside_its_locks(backend):
    # Given locks under two prefixes, one with a waiter, a message record and a superseded record
    backend.acquire("dp1:a:{1}:run", "holder", ttl=10_000)
    backend.join_line(Copy("dp1:a:{1}:run", "m", 1, "handoff"), b"m", order=1, ttl=10_000)
    backend.replace("dp1:a:{2}:queue", "q1", ttl=10_000, superseded_ttl=10_000)
    backend.replace("dp1:a:{2}:queue", "q2", ttl=10_000, superseded_ttl=10_000)
    backend.acquire("dp10:a:{3}:run", "other", ttl=10_000)
    # When one prefix is deleted
    dropped = backend.delete_prefix("dp1:")
    # Then its locks and their records are gone, and the other prefix keeps its own
    assert dropped >= 2  # a row per key on PostgreSQL; Redis and the stub count their waiting lists and records too
    assert list(backend.scan("dp1:*")) == [] and backend.waiters("dp1:a:{1}:run") == []
    assert backend.claim(Copy("dp1:a:{1}:run", "m", 1, "delay")) is True  # no record of the wait is left
    assert backend.current("dp1:a:{2}:queue", "q1").status is CurrentStatus.CURRENT  # nor of the supersession
    assert list(backend.scan("dp10:*")) == ["dp10:a:{3}:run"]
    assert backend.delete_prefix("dp1:") == 0


def waiting(message_id: str, attempt: int = 1) -> Copy:
    """The hand-off copy of a message's reschedule ``attempt`` on KEY."""
    return Copy(KEY, message_id, attempt, "handoff")


def test_release_promotes_the_longest_waiter_once(backend):
    backend.acquire(KEY, "holder", ttl=10_000)
    backend.join_line(waiting("late"), b"late", order=2, ttl=10_000)
    backend.join_line(waiting("early"), b"early", order=1, ttl=10_000)
    assert backend.release(KEY, "holder").promoted == b"early"
    # the freed slot is reserved for the promoted message: another owner waits, its own copy takes it
    assert not backend.acquire(KEY, "holder2", ttl=10_000).acquired
    assert backend.acquire(KEY, "early/2", ttl=10_000).acquired
    assert backend.release(KEY, "early/2").promoted == b"late"
    assert backend.acquire(KEY, "late/3", ttl=10_000).acquired
    assert backend.release(KEY, "late/3").promoted is None


def test_a_release_by_a_non_owner_hands_nothing_over(backend):
    backend.acquire(KEY, "holder", ttl=10_000)
    backend.join_line(waiting("m"), b"m", order=1, ttl=10_000)
    assert backend.release(KEY, "stranger") == Release(False, None)
    assert backend.release(KEY, "holder").promoted == b"m"


def deliver(backend, copy: Copy, owner: str):
    """A delivery of ``copy``: its start, as the middleware makes it."""
    return backend.start(KEY, owner, ttl=10_000, limit=1, lock="x", copy=copy).acquisition


def test_the_first_copy_of_a_reschedule_wins_and_its_retries_rerun(backend):
    backend.acquire(KEY, "holder", ttl=10_000)
    backend.join_line(waiting("m"), b"m", order=1, ttl=10_000)
    backend.release(KEY, "holder")
    handoff, delay = Copy(KEY, "m", 1, "handoff"), Copy(KEY, "m", 1, "delay")
    assert deliver(backend, handoff, "m/1").acquired
    assert deliver(backend, delay, "m/2").refused == "lost"
    # the original, and copies of earlier reschedules, are stale
    assert deliver(backend, Copy(KEY, "m", 0, ""), "m/3").refused is CopyVerdict.STALE
    assert backend.acquire("test:actor:{abc}:queue", "m", ttl=1_000, copy=delay).refused is CopyVerdict.LOST
    assert backend.acquire("test:actor:{abc}:queue", "m", ttl=1_000, copy=handoff).acquired
    # a redelivery of the winner whose worker died (its lease lapsed) runs again
    assert backend.extend([(KEY, "m/1")], 1) == [True]
    time.sleep(0.01)
    assert deliver(backend, handoff, "m/4").acquired
    # and when that run fails, its Retries copy runs
    backend.release(KEY, "m/4")
    assert deliver(backend, handoff._replace(retries=1), "m/5").acquired


def test_a_copy_of_a_run_that_ended_is_a_duplicate(backend):
    # Given a rescheduled message whose delayed copy won and ran
    backend.acquire(KEY, "holder", ttl=10_000)
    backend.join_line(waiting("m"), b"m", order=1, ttl=10_000)
    delay = Copy(KEY, "m", 1, "delay")
    backend.release(KEY, "holder", hand_over=False)
    assert deliver(backend, delay, "m/1").acquired
    # When a second publish of that copy is delivered while it runs, and waits behind it
    assert not deliver(backend, delay, "m/2").acquired
    backend.join_line(waiting("m", 2), b"m-again", order=1, ttl=10_000)
    # Then the end of the run (it succeeded) withdraws that waiter, and every later copy of it is a duplicate
    assert backend.release(KEY, "m/1", succeeded=True).promoted is None
    assert deliver(backend, delay, "m/3").refused == "done"
    assert deliver(backend, Copy(KEY, "m", 2, "delay"), "m/4").refused == "done"
    assert backend.acquire("test:actor:{abc}:queue", "m", ttl=1_000, copy=delay).refused == "done"
    # but a Retries copy of it (the run failed) runs, once
    retry = delay._replace(retries=1)
    assert deliver(backend, retry, "m/5").acquired
    backend.release(KEY, "m/5", succeeded=True)
    started = backend.start(KEY, "m/6", ttl=10_000, limit=1, lock="x", copy=retry)
    assert started.acquisition.refused == "done" and started.duplicate_of == "m/5"


def test_a_failed_run_never_finishes_its_message(backend):
    # Given a rescheduled message whose delayed copy won and ran
    backend.acquire(KEY, "holder", ttl=10_000)
    backend.join_line(waiting("m"), b"m", order=1, ttl=10_000)
    backend.release(KEY, "holder", hand_over=False)
    delay = Copy(KEY, "m", 1, "delay")
    assert deliver(backend, delay, "m/1").acquired
    # When the run fails (its Retries enqueue lost, its ack lost too)
    assert backend.release(KEY, "m/1", succeeded=False).held
    # Then the broker's redelivery of the copy that ran runs, and so does a replay of it, retries reset
    assert deliver(backend, delay, "m/2").acquired
    backend.release(KEY, "m/2")
    assert deliver(backend, delay._replace(retries=0), "m/3").acquired
    # and once a run of it succeeded, the same copy again is a duplicate of that run
    backend.release(KEY, "m/3", succeeded=True)
    started = backend.start(KEY, "m/4", ttl=10_000, limit=1, lock="x", copy=delay)
    assert started.acquisition.refused is CopyVerdict.DONE and started.duplicate_of == "m/3"


def start_copy(backend, copy: Copy, owner: str, order: int, reserve: int = 10_000) -> Start:
    return backend.start(KEY, owner, ttl=10_000, limit=1, lock="x", copy=copy, order=order, reserve=reserve)


def test_a_hand_off_reserves_the_key_for_its_message(backend):
    # Given two waiters behind a holder
    backend.acquire(KEY, "holder", ttl=10_000)
    backend.join_line(waiting("a"), b"a", order=1, ttl=10_000)
    backend.join_line(waiting("b"), b"b", order=2, ttl=10_000)
    # When the holder's release hands the key to the oldest
    assert backend.release(KEY, "holder", succeeded=True).promoted == b"a"
    # Then the later waiter's delayed copy stays in line and changes nothing, a new send waits too
    b_delay = start_copy(backend, Copy(KEY, "b", 1, "delay"), "b/1", order=2)
    assert b_delay.in_line and not b_delay.acquisition.acquired and b_delay.acquisition.holder == "a"
    assert [w.message_id for w in backend.waiters(KEY)] == ["b"]
    new = start_copy(backend, Copy(KEY, "n"), "n/1", order=3)
    assert not new.in_line and not new.acquisition.acquired and new.promoted is None
    # and the first copy of the promoted message to come takes it (its delayed copy here), the other is lost
    assert start_copy(backend, Copy(KEY, "a", 1, "delay"), "a/1", order=1).acquisition.acquired
    assert start_copy(backend, Copy(KEY, "a", 1, "handoff"), "a/2", order=1).acquisition.refused == "lost"
    assert backend.release(KEY, "a/1", succeeded=True).promoted == b"b"


def test_a_free_key_goes_to_its_oldest_waiter_first(backend):
    # Given two waiters behind a holder that died (its lease ran out, no release handed the key over)
    backend.acquire(KEY, "holder", ttl=50)
    backend.join_line(waiting("a"), b"a", order=10, ttl=10_000)
    backend.join_line(waiting("b"), b"b", order=20, ttl=10_000)
    time.sleep(0.1)
    # When the later waiter's delayed copy comes first, it hands the key to the oldest and waits
    late = start_copy(backend, Copy(KEY, "b", 1, "delay"), "b/1", order=20)
    assert late.in_line and late.promoted == b"a" and not late.acquisition.acquired
    # Then the oldest's hand-off copy takes it, and a copy sent before every waiter would have taken it at once
    assert start_copy(backend, Copy(KEY, "a", 1, "handoff"), "a/1", order=10).acquisition.acquired
    backend.release(KEY, "a/1", succeeded=True, reserve=10_000)
    backend.delete(KEY)
    assert start_copy(backend, Copy(KEY, "old"), "old/1", order=5).acquisition.acquired


def test_a_reservation_runs_out(backend):
    # Given a key handed to a waiter whose hand-off copy is lost
    backend.acquire(KEY, "holder", ttl=10_000)
    backend.join_line(waiting("a"), b"a", order=1, ttl=10_000)
    assert backend.release(KEY, "holder", reserve=50).promoted == b"a"
    assert not start_copy(backend, Copy(KEY, "n"), "n/1", order=2).acquisition.acquired
    # Then after its reservation the key is free for any copy
    time.sleep(0.1)
    assert start_copy(backend, Copy(KEY, "n"), "n/2", order=2).acquisition.acquired


def test_a_message_record_lives_only_while_a_copy_of_it_can_arrive(redis_backend):
    backend, client = redis_backend, redis_backend.client
    record, day = f"{KEY}:m:m", 86_400_000
    # Given a message waiting behind a holder: its record lives as long as its lock could
    backend.acquire(KEY, "holder", ttl=10_000)
    backend.join_line(waiting("m"), b"m", order=1, ttl=day)
    assert client.pttl(record) > day - 60_000
    # When the holder hands it the key and the hand-off copy runs, the delayed copy is still to come
    assert backend.release(KEY, "holder").promoted == b"m"
    assert deliver(backend, Copy(KEY, "m", 1, "handoff"), "m/1").acquired
    backend.release(KEY, "m/1", succeeded=True)
    assert client.pttl(record) > day - 60_000
    # Then once the delayed copy arrived (and was skipped), the record lives only the duplicate window
    assert deliver(backend, Copy(KEY, "m", 1, "delay"), "m/2").refused == "done"
    assert 0 < client.pttl(record) <= DUPLICATE_WINDOW
    assert DUPLICATE_WINDOW == 600_000


def test_the_duplicate_window_is_one_figure():
    from pathlib import Path

    import dramatiq_unique.backends.redis as redis_backend

    lua = (Path(redis_backend.__file__).parent / "lua" / "_claim.lua").read_text()
    assert f"local DUPLICATE_WINDOW = {DUPLICATE_WINDOW}\n" in lua


def test_a_retired_copy_wins_its_attempt_and_finishes_nothing(backend):
    # Given a rescheduled message whose hand-off copy is dead-lettered (claimed, never started)
    backend.join_line(waiting("m"), b"m", order=1, ttl=10_000)
    handoff = Copy(KEY, "m", 1, "handoff")
    assert backend.claim(handoff) is True
    # Then the claim sent again after a lost reply still says so, and the attempt's other copy never runs
    assert backend.claim(handoff) is True
    assert backend.claim(Copy(KEY, "m", 1, "delay")) is False
    # but an operator's replay of the dead letter runs, as it is or with its retries reset
    assert deliver(backend, handoff, "m/1").acquired
    backend.release(KEY, "m/1")
    assert deliver(backend, handoff._replace(retries=0), "m/2").acquired


def test_a_waiter_that_arrives_by_its_delay_is_not_promoted_later(backend):
    backend.acquire(KEY, "holder", ttl=10_000)
    backend.join_line(waiting("m"), b"m", order=1, ttl=10_000)
    assert backend.claim(Copy(KEY, "m", 1, "delay")) is True
    assert backend.release(KEY, "holder").promoted is None


def test_a_wait_sent_again_after_its_lost_reply_changes_nothing(backend):
    # Given a waiter registered for attempt 1, whose reply was lost (a reset connection)
    backend.acquire(KEY, "holder", ttl=10_000)
    backend.join_line(waiting("m"), b"m", order=1, ttl=10_000)
    # While the client backs off, the holder hands the key over and the hand-off copy starts
    assert backend.release(KEY, "holder").promoted == b"m"
    assert backend.claim(Copy(KEY, "m", 1, "handoff")) is True
    # When the client sends the same wait again
    backend.join_line(waiting("m"), b"m", order=1, ttl=10_000)
    # Then the hand-off copy stays the attempt's winner: its delayed copy may not run beside it,
    # and the message waits for no second hand-off
    assert backend.claim(Copy(KEY, "m", 1, "delay")) is False
    assert backend.acquire(KEY, "m/2", ttl=10_000).acquired  # the slot was reserved for m
    assert backend.release(KEY, "m/2").promoted is None


def test_a_later_reschedule_makes_the_earlier_copies_stale(backend):
    backend.acquire(KEY, "holder", ttl=10_000)
    backend.join_line(waiting("m", 1), b"m1", order=1, ttl=10_000)
    assert deliver(backend, Copy(KEY, "m", 1, "delay"), "m/1").holder == "holder"
    backend.join_line(waiting("m", 2), b"m2", order=1, ttl=10_000)
    assert deliver(backend, Copy(KEY, "m", 1, "delay"), "m/2").refused == "stale"
    assert deliver(backend, Copy(KEY, "m", 1, "handoff"), "m/3").refused == "stale"
    assert backend.claim(Copy(KEY, "m", 2, "delay")) is True


def test_start_claims_takes_and_releases_the_enqueue_lock_at_once(backend):
    queue_key = "test:actor:{abc}:queue"
    backend.acquire(queue_key, "m", ttl=10_000)
    backend.join_line(waiting("m"), b"m", order=1, ttl=10_000)
    copy = Copy(KEY, "m", 1, "delay")
    started = backend.start(KEY, "m/1", ttl=10_000, limit=1, lock="x", copy=copy, queue_key=queue_key)
    assert started.acquisition.acquired and started.queue_released
    assert backend.inspect(queue_key) is None
    # the other copy of the same reschedule is refused and takes nothing
    other = backend.start(KEY, "m/2", ttl=10_000, limit=1, lock="x", copy=Copy(KEY, "m", 1, "handoff"))
    assert type(other) is Start and other.acquisition.refused is CopyVerdict.LOST
    assert set(backend.inspect(KEY).holders) == {"m/1"}
    # a conflict keeps the enqueue lock
    backend.acquire(queue_key, "n", ttl=10_000)
    held = backend.start(KEY, "n/1", ttl=10_000, limit=1, lock="x", copy=Copy(KEY, "n"), queue_key=queue_key)
    assert not held.acquisition.acquired and held.acquisition.holder == "m/1" and not held.queue_released
    assert set(backend.inspect(queue_key).holders) == {"n"}


def test_acquire_is_atomic_under_contention(backend):
    # Given 16 threads racing for a key with limit 2
    barrier = threading.Barrier(16)
    wins = []

    def race(owner):
        barrier.wait()
        if backend.acquire(KEY, owner, ttl=10_000, limit=2).acquired:
            wins.append(owner)

    threads = [threading.Thread(target=race, args=(f"o{i}",)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 2


def test_redis_keeps_one_key_per_held_lock_with_a_deadline(redis_backend, redis_client):
    redis_backend.acquire(KEY, "a", ttl=10_000)
    assert redis_client.keys("*") == [KEY.encode()]
    assert 9_000 < redis_client.pttl(KEY) <= 10_000
    redis_backend.release(KEY, "a")
    assert redis_client.keys("*") == []


def test_redis_survives_a_flushed_script_cache(redis_backend, redis_client):
    redis_backend.acquire(KEY, "a", ttl=10_000)
    redis_client.script_flush()
    assert redis_backend.release(KEY, "a").held
    assert redis_backend.acquire(KEY, "b", ttl=10_000).acquired


def test_redis_deadlines_follow_the_server_clock(redis_backend, redis_client):
    seconds, micros = redis_client.time()
    redis_backend.acquire(KEY, "a", ttl=5_000)
    deadline = int(redis_client.hget(KEY, "a"))
    assert abs(deadline - (seconds * 1000 + micros // 1000 + 5_000)) < 1_000


def test_redis_backend_errors_surface(redis_url):
    from tests.conftest import free_port

    dead = RedisBackend(url=f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=0.5)
    with pytest.raises(redis.ConnectionError):
        dead.acquire(KEY, "a", ttl=1000)


def test_a_release_without_hand_over_leaves_the_waiters_waiting(backend):
    backend.acquire(KEY, "holder", ttl=10_000)
    backend.join_line(waiting("m"), b"m", order=1, ttl=10_000)
    assert backend.release(KEY, "holder", hand_over=False) == Release(True, None)
    # the waiter's delayed copy still arrives first and runs
    assert backend.claim(Copy(KEY, "m", 1, "delay")) is True
    backend.acquire(KEY, "holder2", ttl=10_000)
    assert backend.release(KEY, "holder2").promoted is None


def test_waiter_records_expire(backend):
    backend.acquire(KEY, "holder", ttl=10_000)
    backend.join_line(waiting("m"), b"m", order=1, ttl=100)
    time.sleep(0.15)  # the records' own deadline: nothing to poll
    assert backend.release(KEY, "holder").promoted is None
    # with its record gone, any copy runs: nothing is lost
    assert backend.claim(Copy(KEY, "m", 1, "delay")) is True
    assert backend.claim(Copy(KEY, "m", 1, "handoff")) is True


# Typed outcomes: enums and named results at the boundary, the Lua replies decoded inside ---------


def test_a_stale_copy_is_refused_with_a_verdict_that_reads_as_its_text(backend):
    backend.acquire(KEY, "holder", ttl=10_000)
    backend.join_line(waiting("m", 2), b"m", order=1, ttl=10_000)
    assert deliver(backend, Copy(KEY, "m", 2, "delay"), "m/0").holder == "holder"
    got = backend.acquire("test:actor:{abc}:queue", "m", ttl=1_000, copy=Copy(KEY, "m", 1, "delay"))
    assert not got.acquired and got.refused is CopyVerdict.STALE
    # as the plain strings were: equal to, and printed as, their text
    assert got.refused == "stale" and f"{got.refused}" == "stale" and "%s" % got.refused == "stale"
    started = backend.start(KEY, "m/1", ttl=1_000, limit=1, lock="x", copy=Copy(KEY, "m", 1, "handoff"))
    assert started.acquisition.refused is CopyVerdict.STALE and not started.queue_released


def test_a_fresh_start_decodes_to_a_whole_acquisition(backend):
    # start.lua packs a fresh slot's reply as fence * 2 + the queue flag: the backend unpacks it
    queue_key = "test:actor:{abc}:queue"
    backend.acquire(queue_key, "m", ttl=10_000)
    started = backend.start(KEY, "m/1", ttl=10_000, limit=1, lock="x", copy=Copy(KEY, "m"), queue_key=queue_key)
    got = started.acquisition
    assert type(started) is Start and started.queue_released is True
    assert (got.acquired, got.reentered, got.holder, got.provisional, got.refused) == (True, False, "m/1", False, None)
    assert got.fence == backend.inspect(KEY).fence > 0


def test_replace_answers_a_replace_status(backend):
    key = "test:actor:{typed}:queue"
    options = {"ttl": 10_000, "superseded_ttl": 10_000, "lock": "until_executed", "keep_started": True}
    seen = [backend.replace(key, "a", **options), backend.replace(key, "a", **options)]
    seen.append(backend.replace(key, "b", **options))
    backend.current(key, "b")  # b starts
    seen.append(backend.replace(key, "c", **options))
    assert [got.status for got in seen] == [
        ReplaceStatus.ACQUIRED,
        ReplaceStatus.REENTERED,
        ReplaceStatus.REPLACED,
        ReplaceStatus.REFUSED,
    ]
    assert all(type(got.status) is ReplaceStatus for got in seen)
    assert [got.holder for got in seen[2:]] == ["a", "b"]


def test_current_answers_each_current_status(backend):
    key, run_key = "test:actor:{typed}:queue", "test:actor:{typed}:run"
    options = {"ttl": 10_000, "superseded_ttl": 10_000, "lock": "until_executed"}
    reenter = {"reenter": True, "ttl": 10_000, "lock": "until_executed"}
    backend.replace(key, "a", **options)
    backend.replace(key, "b", **options)
    assert backend.current(key, "a") == CurrentCheck(CurrentStatus.SUPERSEDED, "b")
    assert backend.current(key, "b", **reenter) == CurrentCheck(CurrentStatus.REENTERED, "b")
    assert backend.current(key, "b") == CurrentCheck(CurrentStatus.CURRENT)
    # a re-enqueued copy that may not run takes nothing, and says why
    backend.join_line(Copy(run_key, "c", 1, "handoff"), b"c", order=1, ttl=10_000)
    handoff = Copy(run_key, "c", 1, "handoff")
    assert backend.start(run_key, "c/1", ttl=10_000, limit=1, lock="x", copy=handoff).acquisition.acquired
    refused = backend.current(key, "c", copy=Copy(run_key, "c", 1, "delay"), **reenter)
    assert refused == CurrentCheck(CurrentStatus.MAY_NOT_RUN, "lost")
    # a message whose slot lapsed while another holds the key
    assert backend.current(key, "d", **reenter) == CurrentCheck(CurrentStatus.LAPSED, "b")
    backend.release(key, "b")
    assert backend.current(key, "d", **reenter) == CurrentCheck(CurrentStatus.CURRENT, "d")
    assert type(refused) is CurrentCheck and type(refused.status) is CurrentStatus
    # and each status still equals the code current() answered before
    assert [int(status) for status in CurrentStatus] == [-2, 3, 1, 2, 0]


def test_the_abc_names_every_verb_and_sets_the_operator_reads_apart(backend):
    assert isinstance(backend, LockBackend) and isinstance(backend, LockReads)
    reads = {"inspect", "scan", "waiters", "describe"}
    assert reads <= set(vars(LockReads)) and not reads & set(vars(LockBackend))
    # sending with the publish is a capability, found by type, not by duck typing
    assert {"dispatch_client", "acquire_and_dispatch"} <= set(vars(SendsWithPublish))
    assert not {"dispatch_client", "acquire_and_dispatch"} & set(vars(LockBackend))
    if isinstance(backend, RedisBackend):
        # one script may touch the broker's keys, except across a Cluster's slots
        assert isinstance(backend, SendsWithPublish)
        assert backend.dispatch_client is (None if backend.cluster else backend.client)
    else:
        assert not isinstance(backend, SendsWithPublish) and not hasattr(backend, "acquire_and_dispatch")
