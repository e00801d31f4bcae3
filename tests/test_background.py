"""The base of the package's background threads, and the lease keeper's
native renewals under gevent.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import redis

from dramatiq_unique.background import BackgroundThread, pid
from dramatiq_unique.backends.redis import RedisBackend
from dramatiq_unique.worker.leases import native_extend

from tests.conftest import wait_for
from tests.procs import ROOT


def ticking(ticks: list[float], every: float = 10):
    def loop(thread: BackgroundThread) -> None:
        while not thread.stopping:
            ticks.append(time.monotonic())
            thread.wait(every)

    return loop


def test_it_starts_when_first_needed_and_stops_within_its_bound():
    ticks: list[float] = []
    thread = BackgroundThread(name="test-ticks", loop=ticking(ticks))
    assert thread.running_in is None and not ticks
    thread.ensure_started()
    thread.ensure_started()  # once only
    wait_for(lambda: len(ticks) >= 3, what="ticks")
    assert thread.running_in == pid()
    started = time.monotonic()
    assert thread.stop(timeout=1_000)
    assert time.monotonic() - started < 0.5
    wait_for(lambda: thread.running_in is None, what="the thread to end")


def test_an_error_that_ends_the_loop_is_logged_and_the_next_use_starts_it_again(caplog):
    runs: list[int] = []

    def failing(thread: BackgroundThread) -> None:
        runs.append(1)
        raise ValueError("boom")

    thread = BackgroundThread(name="test-failing", loop=failing)
    thread.ensure_started()
    wait_for(lambda: thread.running_in is None and runs, what="the loop to fail")
    wait_for(lambda: "test-failing stopped on an error" in caplog.text, what="the error log")
    assert "ValueError: boom" in caplog.text
    thread.ensure_started()
    wait_for(lambda: len(runs) == 2, what="a second start")


def test_an_old_threads_exit_never_clears_the_running_mark_of_a_newer_one():
    # Given a loop that, told to end, retires under its owner's lock and then takes a while to return
    owner = threading.Lock()
    live: list[int] = []
    starts: list[int] = []
    idents: list[int] = []
    end = [threading.Event() for _ in range(3)]
    returned = [threading.Event() for _ in range(3)]

    def loop(thread: BackgroundThread) -> None:
        run = len(starts)
        starts.append(thread.generation)
        idents.append(threading.get_ident())
        live.append(run)
        end[run].wait(10)
        with owner:
            thread.retire()  # decided to end: a use from now on starts a new thread
        live.remove(run)
        returned[run].wait(10)  # still on its way out

    thread = BackgroundThread(name="test-generations", loop=loop)
    thread.ensure_started()
    wait_for(lambda: live == [0], what="the first thread")
    # When the first one retires, and a use starts a second before the first has returned
    end[0].set()
    wait_for(lambda: not live and thread.running_in is None, what="the first thread to retire")
    thread.ensure_started()
    wait_for(lambda: live == [1], what="the second thread")
    # And the first one returns then
    returned[0].set()
    wait_for(lambda: idents[0] not in {t.ident for t in threading.enumerate()}, what="the first thread to end")
    # Then the second is still marked running, and a use starts no third beside it
    assert thread.running_in == pid()
    thread.ensure_started()
    assert thread.generation == 2 and starts == [1, 2] and live == [1]
    end[1].set()
    returned[1].set()
    assert thread.stop(timeout=1_000)
    assert thread.running_in is None


def test_a_forked_child_has_no_thread_until_it_needs_one():
    ticks: list[float] = []
    forked: list[int] = []
    thread = BackgroundThread(name="test-fork", loop=ticking(ticks), on_fork=lambda: forked.append(1))
    thread.ensure_started()
    wait_for(lambda: ticks, what="ticks")
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        state = f"{thread.running_in}:{len(forked)}"
        count = len(ticks)
        thread.ensure_started()
        deadline = time.monotonic() + 5
        while len(ticks) < count + 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.write(write, f"{state}:{len(ticks) >= count + 2}".encode())
        os._exit(0)
    os.close(write)
    os.waitpid(child, 0)
    assert os.read(read, 100).decode() == "None:1:True"
    thread.stop()


GEVENT_CHECK = """
from gevent import monkey
monkey.patch_all()
import time
from dramatiq_unique.background import BackgroundThread
from dramatiq_unique.compat import original

def ticking(ticks):
    def loop(thread):
        while not thread.stopping:
            ticks.append(1)
            thread.wait(20)
    return loop

native, green = [], []
threads = [BackgroundThread(name="native", loop=ticking(native), native=True),
           BackgroundThread(name="green", loop=ticking(green))]
for thread in threads:
    thread.ensure_started()
time.sleep(0.1)  # yields: both tick
before = len(native), len(green)
original("time", "sleep")(0.5)  # holds the hub, as a C call does
during = len(native) - before[0], len(green) - before[1]
print(threads[0].native, threads[1].native, during[0] >= 10, during[1] <= 1, all(t.stop(timeout=1000) for t in threads))
"""


def test_under_gevent_a_native_task_runs_while_the_hub_is_held_and_a_green_one_does_not():
    pytest.importorskip("gevent", reason="gevent is in the test extra: pip install -e '.[test]'")
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(GEVENT_CHECK)], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.stdout.split() == ["True", "False", "True", "True", "True"], done.stderr


def test_a_native_renewal_extends_a_held_lock_and_reloads_a_flushed_script(redis_url, redis_client):
    backend = RedisBackend(url=redis_url)
    renew = native_extend(backend)
    assert renew is not None
    assert backend.acquire("lease-key", "owner-1", ttl=1_000).acquired
    redis_client.script_flush()  # NOSCRIPT: sent again with EVAL
    assert renew([("lease-key", "owner-1"), ("lease-key", "someone-else")], 60_000, timeout=2_000) == [True, False]
    assert redis_client.pttl("lease-key") > 50_000
    assert renew([("lease-key", "owner-1")], 60_000, timeout=2_000) == [True]  # EVALSHA now
    renew.close()


def test_a_native_renewal_gives_up_at_its_deadline_on_a_silent_server(redis_url):
    silent = redis.Redis.from_url(redis_url)
    backend = RedisBackend(url=redis_url)
    renew = native_extend(backend)
    assert renew is not None
    assert renew([("quiet-key", "owner")], 1_000, timeout=1_000) == [False]  # connected
    silent.execute_command("CLIENT", "PAUSE", 600, "ALL")
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        renew([("quiet-key", "owner")], 1_000, timeout=200)
    assert time.monotonic() - started < 0.45
    time.sleep(0.45)


def test_backends_without_a_native_connection_renew_as_before():
    from dramatiq_unique import StubBackend

    assert native_extend(StubBackend()) is None
