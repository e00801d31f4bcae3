"""Provisional enqueue locks and their confirmation, and the reaper's
compare-and-release, on both backends; and the middleware's use of them
on the broker kinds that run in-process.
"""

from __future__ import annotations

import time

import dramatiq
import pytest

from dramatiq_unique import UniqueMiddleware
from dramatiq_unique.ops.admin import LockAdmin
from dramatiq_unique.backends.records import EnqueueRecord
from tests.conftest import make_worker, wait_for

KEY = "t:job:{0123456789abcdef0123456789abcdef}:queue"
DAY = 86_400_000


class LaterHook(dramatiq.Middleware):
    """A later ``before_enqueue``: the send fast path, which takes the lock
    confirmed in the publish itself, stands aside for it.
    """

    def before_enqueue(self, broker, message, delay):  # type: ignore[no-untyped-def]
        pass


def holder(backend, owner: str = "m1"):  # type: ignore[no-untyped-def]
    info = backend.inspect(KEY)
    return (info.holders.get(owner), info.records.get(owner)) if info is not None else (None, None)


def test_a_new_slot_is_provisional_until_confirmed(backend):
    got = backend.acquire(KEY, "m1", ttl=DAY, lock="until_executed", provisional=300, where="ns\tq\tr1")
    assert got.acquired and got.provisional
    deadline, record = holder(backend)
    assert record.provisional_until and deadline <= time.time() * 1000 + 300
    assert record.where == "ns\tq\tr1" and record.before == ""
    # Confirming gives it its full lifetime, and marks it confirmed
    assert backend.confirm([(KEY, "m1", DAY)]) == [True]
    deadline, record = holder(backend)
    assert deadline > time.time() * 1000 + DAY - 5_000 and record.provisional_until == 0


def test_an_unconfirmed_slot_lapses_after_the_window(backend):
    backend.acquire(KEY, "m1", ttl=DAY, provisional=100, where="")
    assert not backend.acquire(KEY, "m2", ttl=DAY, provisional=100, where="").acquired
    wait_for(lambda: backend.acquire(KEY, "m2", ttl=DAY, provisional=100, where="").acquired, timeout=2)


@pytest.mark.parametrize("then", ["released", "lapsed_and_taken"])
def test_a_confirmation_never_revives_a_slot_that_is_gone(backend, then):
    backend.acquire(KEY, "m1", ttl=DAY, provisional=100, where="")
    if then == "released":
        assert backend.release(KEY, "m1").held
    else:
        wait_for(lambda: backend.acquire(KEY, "m2", ttl=DAY, where="").acquired, timeout=2)
    assert backend.confirm([(KEY, "m1", DAY)]) == [False]
    assert holder(backend, "m1") == (None, None)
    if then == "lapsed_and_taken":
        assert backend.inspect(KEY).holders.keys() == {"m2"}
    else:
        assert backend.inspect(KEY) is None


def test_reentering_a_confirmed_slot_takes_the_full_ttl_and_remembers_both_places(backend):
    backend.acquire(KEY, "m1", ttl=DAY, provisional=300, where="ns\tq.DQ\tr1")
    backend.confirm([(KEY, "m1", DAY)])
    # A delay-queue move re-enters it, publishing to another place
    got = backend.acquire(KEY, "m1", ttl=DAY, provisional=300, where="ns\tq\tr2")
    assert got.reentered and not got.provisional
    deadline, record = holder(backend)
    assert deadline > time.time() * 1000 + DAY - 5_000
    assert (record.where, record.before, record.provisional_until) == ("ns\tq\tr2", "ns\tq.DQ\tr1", 0)


def test_reentering_a_provisional_slot_keeps_it_provisional(backend):
    # A RabbitMQ publish retry: before_enqueue runs again before any publish returned
    backend.acquire(KEY, "m1", ttl=DAY, provisional=300, where="\tq\t")
    got = backend.acquire(KEY, "m1", ttl=DAY, provisional=300, where="\tq\t")
    assert got.reentered and got.provisional
    deadline, record = holder(backend)
    assert deadline <= time.time() * 1000 + 300 and record.provisional_until


def test_reap_releases_only_an_unchanged_record(backend):
    backend.acquire(KEY, "m1", ttl=DAY, where="ns\tq\tr1")
    _, checked = holder(backend)
    # The message moved after the reaper looked: its record changed, so the slot stays
    backend.acquire(KEY, "m1", ttl=DAY, where="ns\tq\tr2")
    assert not backend.reap(KEY, "m1", checked)
    assert holder(backend)[0] is not None
    _, current = holder(backend)
    assert backend.reap(KEY, "m1", current)
    assert backend.inspect(KEY) is None
    assert not backend.reap(KEY, "m1", current)


def test_run_locks_record_when_they_were_taken_and_no_place(backend):
    before = int(time.time() * 1000)
    backend.acquire(KEY, "m1/t", ttl=1_000)
    [(owner, record)] = backend.inspect(KEY).records.items()
    assert owner == "m1/t" and (record.provisional_until, record.where, record.before) == (0, "", "")
    assert before - 5 <= record.taken_at <= time.time() * 1000 + 5
    assert EnqueueRecord.decode("garbage") is None


# The middleware -------------------------------------------------------------


def test_a_send_takes_one_provisional_lock_and_confirms_it_off_the_callers_thread(any_broker, redis_backend):
    calls = []
    acquire, confirm = redis_backend.acquire, redis_backend.confirm

    def counted_acquire(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(("acquire", threading_name()))
        return acquire(*args, **kwargs)

    def counted_confirm(locks):  # type: ignore[no-untyped-def]
        calls.append(("confirm", threading_name(), len(locks)))
        return confirm(locks)

    redis_backend.acquire, redis_backend.confirm = counted_acquire, counted_confirm
    unique = UniqueMiddleware(backend=redis_backend, prefix="p9", provisional_window=5_000)
    any_broker.add_middleware(unique)
    any_broker.add_middleware(LaterHook())

    @dramatiq.actor(broker=any_broker, lock="until_executed")
    def job(n):  # type: ignore[no-untyped-def]
        pass

    for n in range(20):
        job.send(n)
    assert unique.flush_confirmations()
    mine = threading_name()
    assert [c for c in calls if c[1] == mine] == [("acquire", mine)] * 20
    confirmed = [c for c in calls if c[0] == "confirm"]
    assert sum(c[2] for c in confirmed) == 20 and len(confirmed) < 20
    assert all(not h.provisional for lock in LockAdmin(redis_backend, prefix="p9").locks() for h in lock.holders)


def test_a_message_run_before_its_confirmation_is_not_locked_again(stub_broker, redis_backend):
    unique = UniqueMiddleware(backend=redis_backend, prefix="p9", provisional_window=5_000)
    stub_broker.add_middleware(unique)
    ran = []

    @dramatiq.actor(broker=stub_broker, lock="until_executed")
    def job():  # type: ignore[no-untyped-def]
        ran.append(1)

    worker = make_worker(stub_broker)
    try:
        for _ in range(20):
            job.send()
            wait_for(lambda: not list(LockAdmin(redis_backend, prefix="p9").locks()), what="the lock to be released")
        assert unique.flush_confirmations()
        assert len(ran) == 20
        assert list(LockAdmin(redis_backend, prefix="p9").locks()) == []
    finally:
        worker.stop()


def threading_name() -> str:
    import threading

    return threading.current_thread().name


def test_operators_see_the_age_deadline_and_state_of_enqueue_locks(redis_backend, redis_url):
    import json
    import os
    import subprocess
    import sys

    from tests.procs import ROOT

    # Given one provisional and one confirmed enqueue lock, and a run lock
    prefix = "p9ops"
    provisional = f"{prefix}:job:{{{'a' * 32}}}:queue"
    confirmed = f"{prefix}:job:{{{'b' * 32}}}:queue"
    redis_backend.acquire(provisional, "m1", ttl=DAY, lock="until_executed", provisional=60_000, where="")
    redis_backend.acquire(confirmed, "m2", ttl=DAY, lock="until_executed", provisional=60_000, where="")
    redis_backend.confirm([(confirmed, "m2", DAY)])
    redis_backend.acquire(f"{prefix}:job:{{{'c' * 32}}}:run", "m3/t", ttl=60_000, lock="while_executing")

    def run(*args: str) -> str:
        env = {k: v for k, v in os.environ.items() if not k.lower().startswith("dramatiq_unique_")}
        command = [sys.executable, "-m", "dramatiq_unique", *args, "--redis", redis_url, "--prefix", prefix]
        done = subprocess.run(command, env={**env, "PYTHONPATH": str(ROOT)}, cwd=ROOT, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    # Then `locks` shows each one's age and state, `inspect` when it was taken and that it is provisional
    lines = run("locks").splitlines()
    assert lines[0].split()[-2:] == ["STATE", "WAITING"]
    rows = {line.split()[1]: line.split() for line in lines[1:-1]}
    assert [rows[c * 32][-2] for c in "abc"] == ["provisional", "confirmed", "-"]
    assert rows["a" * 32][5] != "-" and rows["c" * 32][5] not in ("-", "?")  # a run lock has its age too
    shown = run("inspect", "a" * 32)
    assert "taken   " in shown and "provisional: lapses then unless its publish is confirmed" in shown
    # And the JSON the dashboard serves says the same
    data = {lock["digest"]: lock for lock in json.loads(run("locks", "--json"))}
    [first] = data["a" * 32]["holders"]
    assert first["provisional"] is True and time.time() * 1000 - 60_000 < first["taken_at"] <= time.time() * 1000
    assert first["deadline"] <= time.time() * 1000 + 60_000
    assert data["b" * 32]["holders"][0]["provisional"] is False
    assert data["c" * 32]["holders"][0]["taken_at"] is not None  # a run lock records when it was taken


def test_the_confirmer_replaces_a_call_stuck_on_a_silent_backend(monkeypatch):
    import threading

    from dramatiq_unique import StubBackend
    from dramatiq_unique.send import confirm
    from dramatiq_unique.send.confirm import Confirmer, Pending

    monkeypatch.setattr(confirm, "CALL_TIMEOUT", 200)
    release = threading.Event()

    class Silent(StubBackend):
        """A backend whose first confirmation never answers (until the test ends)."""

        calls = 0

        def confirm(self, locks):  # type: ignore[no-untyped-def]
            Silent.calls += 1
            if Silent.calls == 1:
                release.wait(10)
            return super().confirm(locks)

    backend = Silent()
    lapsed: list[Pending] = []
    confirmer = Confirmer(backend, on_lapsed=lapsed.append)
    try:
        # Given a provisional lock whose first confirmation gets stuck
        backend.acquire(KEY, "m1", ttl=DAY, provisional=5_000, where="")
        confirmer.submit([Pending(KEY, "m1", DAY, "job", time.monotonic() * 1000 + 5_000)])
        wait_for(lambda: Silent.calls == 1, what="the first call")
        # Then the next flush gives up on that call after CALL_TIMEOUT and confirms the lock on a new thread
        assert confirmer.flush(timeout=3)
        assert Silent.calls == 2
        _, record = holder(backend)
        assert record.provisional_until == 0 and lapsed == []
    finally:
        release.set()
        confirmer.stop(timeout=1)


def test_a_lock_that_could_not_be_confirmed_in_its_window_is_reported_lapsed():
    from dramatiq_unique import StubBackend
    from dramatiq_unique.send.confirm import Confirmer, Pending

    class Down(StubBackend):
        def confirm(self, locks):  # type: ignore[no-untyped-def]
            raise ConnectionError("down")

    lapsed: list[Pending] = []
    confirmer = Confirmer(Down(), on_lapsed=lapsed.append)
    try:
        lock = Pending(KEY, "m1", DAY, "job", time.monotonic() * 1000 + 300)
        confirmer.submit([lock])
        wait_for(lambda: lapsed == [lock], timeout=5, what="the lock to be reported lapsed")
        assert confirmer.flush(timeout=1)
    finally:
        confirmer.stop(timeout=1)
