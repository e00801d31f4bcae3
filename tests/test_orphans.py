"""No orphaned enqueue locks: a key whose message exists nowhere is
free within a minute.

Real processes throughout: producers that die inside the broker's
publish, ``dramatiq`` worker groups, and the ``dramatiq-unique`` command.
The app is ``tests/apps/orphans.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from typing import Iterator, Optional

import pika  # type: ignore[import-untyped]
import pytest
import redis

from dramatiq_unique.ops.admin import Lock, LockAdmin
from dramatiq_unique.backends.redis import RedisBackend
from tests.conftest import wait_for
from tests.procs import ROOT, WorkerGroup

APP = "tests.apps.orphans"

#: The provisional window the tests use, in ms: seconds, not 30 s.
WINDOW = 2_000


class Orphans:
    """One test's namespace, environment, app and locks."""

    def __init__(self, redis_url: str, broker: str, rabbitmq_url: str = "", **env: str) -> None:
        self.namespace = f"o{uuid.uuid4().hex[:8]}"
        self.env = {
            "ORPHANS_BROKER": broker,
            "ORPHANS_REDIS_URL": redis_url,
            "ORPHANS_RABBITMQ_URL": rabbitmq_url,
            "ORPHANS_NAMESPACE": self.namespace,
            "dramatiq_unique_provisional_window": str(WINDOW),
            "dramatiq_worker_timeout": "100",
            **env,
        }
        self.redis_url = redis_url
        self.records = redis.Redis.from_url(redis_url)
        self.admin = LockAdmin(RedisBackend(url=redis_url), prefix=self.namespace)
        self.groups: list[WorkerGroup] = []
        self._app: Optional[object] = None

    @property
    def app(self):  # type: ignore[no-untyped-def]
        """The app, built in the test process with the same environment."""
        if self._app is None:
            os.environ.update(self.env)
            sys.modules.pop(APP, None)
            import tests.apps.orphans as app

            self._app = app
        return self._app

    def produce(self, mode: str, queue: str, key: str) -> subprocess.CompletedProcess[str]:
        """Run a producer process that sends one message."""
        env = {**os.environ, **self.env, "PYTHONPATH": str(ROOT)}
        return subprocess.run([sys.executable, "-m", APP, mode, queue, key], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=60)

    def workers(self, processes: int = 1, threads: int = 2, queues: tuple[str, ...] = ("run",), **env: str):  # type: ignore[no-untyped-def]
        names = [f"{self.namespace}-{q}" if self.env["ORPHANS_BROKER"] == "rabbitmq" else q for q in queues]
        group = WorkerGroup(f"{APP}:broker", processes=processes, threads=threads, env={**self.env, **env},
                            extra=("-Q", *names))
        self.groups.append(group.start())
        group.wait_booted(processes, timeout=60)
        return group

    def lock(self, key: str) -> Optional[Lock]:
        """The enqueue lock of ``key`` (on actor job_run), if held."""
        found = [lock for lock in self.admin.locks(actor="job_run", phase="queue")
                 if f'"{key}"' in (lock.lock_args or "")]
        return found[0] if found else None

    def locked_keys(self) -> dict[str, str]:
        """key -> holder message id, of every enqueue lock."""
        return {json.loads(lock.lock_args or "{}")["key"]: lock.holders[0].message_id
                for lock in self.admin.locks(phase="queue")}

    def runs(self, kind: str = "runs") -> list[dict]:
        return [json.loads(raw) for raw in self.records.lrange(f"{self.namespace}:{kind}", 0, -1)]

    def open_gate(self, gate: str) -> None:
        self.records.set(f"{self.namespace}:gate:{gate}", 1)

    def close(self) -> None:
        for group in self.groups:
            if group.process is not None and group.process.poll() is None:
                group.stop(timeout=15)
            print(f"--- {' '.join(group.args[2:])}\n{group.output()[-4000:]}")
        if self._app is not None:
            self._app.broker.close()  # type: ignore[attr-defined]
        if self.env["ORPHANS_BROKER"] == "rabbitmq":
            connection = pika.BlockingConnection(pika.URLParameters(self.env["ORPHANS_RABBITMQ_URL"]))
            channel = connection.channel()
            for queue in ("run", "gone", "kept"):
                for suffix in ("", ".DQ", ".XQ"):
                    channel.queue_delete(f"{self.namespace}-{queue}{suffix}")
            connection.close()
        self.records.close()


@pytest.fixture
def orphans(redis_client, redis_url, request) -> Iterator:  # type: ignore[no-untyped-def]
    made: list[Orphans] = []
    saved = dict(os.environ)

    def make(broker: str = "redis", **env: str) -> Orphans:
        rabbitmq_url = request.getfixturevalue("rabbitmq_url") if broker == "rabbitmq" else ""
        made.append(Orphans(redis_url, broker, rabbitmq_url, **env))
        return made[-1]

    yield make
    for o in made:
        o.close()
    os.environ.clear()
    os.environ.update(saved)
    sys.modules.pop(APP, None)


# Producer crash -----------------------------------------------------------


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_a_producer_that_dies_inside_the_publish_leaves_a_key_that_frees_itself(orphans, broker, request):
    if broker == "rabbitmq":
        request.getfixturevalue("rabbitmq_url")
    # (On Redis, the two-step path: the send fast path takes the lock in its publish, see below.)
    o = orphans(broker, ORPHANS_TWO_STEP="1")
    # Given a producer process that dies inside the broker's publish, after taking the lock of key k
    died = o.produce("die", "run", "k")
    assert died.returncode == 9, died.stderr
    died_at = time.time()
    # Then its lock is held, but only provisionally: it lapses within the window
    lock = o.lock("k")
    assert lock is not None and lock.holders[0].provisional
    assert lock.holders[0].deadline <= died_at * 1000 + WINDOW
    # And a new send of k is refused while it holds, and accepted once the window has passed
    app = o.app
    assert app.job_run.send("k").options.get("unique_duplicate_of") == lock.holders[0].message_id
    accepted = []

    def sent() -> bool:
        message = app.job_run.send("k")
        if message.options.get("unique_duplicate_of") is None:
            accepted.append((message, time.time()))
        return bool(accepted)

    wait_for(sent, timeout=60, interval=0.1, what="a new send of k to be accepted")
    message, accepted_at = accepted[0]
    assert accepted_at - died_at < WINDOW / 1000 + 5
    # And that normal send's lock is confirmed to its full lifetime once published
    assert app.unique.flush_confirmations()
    lock = o.lock("k")
    assert lock is not None and not lock.holders[0].provisional
    assert lock.holders[0].message_id == message.message_id
    assert lock.holders[0].deadline > time.time() * 1000 + 86_000_000
    # And it behaves as before: duplicates are refused while queued, it runs once, and then k is free
    assert app.job_run.send("k").options.get("unique_duplicate_of") == message.message_id
    o.workers()
    wait_for(lambda: len(o.runs()) == 1, timeout=30, what="the run of k")
    assert o.runs()[0]["message_id"] == message.message_id
    wait_for(lambda: o.lock("k") is None, what="the lock of k to be released")


def test_a_producer_that_dies_inside_the_send_fast_path_leaves_its_lock_only_with_its_message(orphans):
    o = orphans()
    # Given a producer process that dies once the fast path's one script went out, before its reply
    died = o.produce("die-in-send", "run", "k")
    assert died.returncode == 9, died.stderr
    # Then its lock and its message are both there, or neither is: the script takes both or none
    lock, queued = o.lock("k"), o.records.lrange(f"{o.namespace}:run", 0, -1)
    assert (lock is None) == (not queued)
    if lock is None:
        return
    # And the lock is confirmed at once, for its full lifetime: nothing was left to confirm
    assert not lock.holders[0].provisional and lock.holders[0].deadline > time.time() * 1000 + 86_000_000
    # And a worker runs the message once, and then k is free
    o.workers()
    wait_for(lambda: len(o.runs()) == 1, timeout=30, what="the run of k")
    assert o.runs()[0]["message_id"] == lock.holders[0].message_id
    wait_for(lambda: o.lock("k") is None, what="the lock of k to be released")


def test_in_the_crash_window_the_lock_lapses_and_the_queued_message_still_runs_sanely(orphans):
    o = orphans(ORPHANS_TWO_STEP="1")  # the send fast path has no crash window
    # Given a producer that dies after its publish returned, before confirming the lock of k
    died = o.produce("die-after-publish", "run", "k")
    assert died.returncode == 9, died.stderr
    original = o.lock("k").holders[0].message_id
    # Then the lock lapses after the window although the message is queued, and a second send is accepted
    wait_for(lambda: o.lock("k") is None, timeout=WINDOW / 1000 + 5, what="the provisional lock to lapse")
    second = o.app.job_run.send("k", gate="second")
    assert second.options.get("unique_duplicate_of") is None
    assert o.app.unique.flush_confirmations()
    # And when a worker runs both in turn, the original's release leaves the second's lock alone
    o.workers(threads=1)
    wait_for(lambda: len(o.runs()) == 1 and len(o.runs("starts")) == 2, timeout=30, what="the original's run")
    assert o.runs()[0]["message_id"] == original
    assert o.lock("k").holders[0].message_id == second.message_id
    # And each runs once, and k is free after both
    o.open_gate("second")
    wait_for(lambda: len(o.runs()) == 2, timeout=30, what="both runs")
    assert sorted(run["message_id"] for run in o.runs()) == sorted([original, second.message_id])
    wait_for(lambda: o.lock("k") is None, what="k to be free after both runs")
    group = o.groups[0]
    wait_for(lambda: "lapsed before it was released" in group.output(), what="the lapse to be logged")


def test_rabbitmq_publish_retries_reenter_the_provisional_lock_and_confirm_it_once(orphans, request, monkeypatch):
    request.getfixturevalue("rabbitmq_url")
    o = orphans("rabbitmq")
    app = o.app
    from pika.adapters.blocking_connection import BlockingChannel
    from pika.exceptions import AMQPConnectionError

    # Given a RabbitMQ publish that fails twice before it goes through
    publish, failures = BlockingChannel.basic_publish, []

    def flaky(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if len(failures) < 2:
            failures.append(1)
            raise AMQPConnectionError("cut")
        return publish(self, *args, **kwargs)

    monkeypatch.setattr(BlockingChannel, "basic_publish", flaky)
    # When a message is sent: before_enqueue runs three times for it
    message = app.job_kept.send("k")
    assert failures == [1, 1] and message.options.get("unique_duplicate_of") is None
    # Then it holds one lock, confirmed once the send returned, to its full lifetime
    assert app.unique.flush_confirmations()
    [lock] = list(o.admin.locks(phase="queue"))
    assert [h.message_id for h in lock.holders] == [message.message_id]
    assert not lock.holders[0].provisional and lock.holders[0].deadline > time.time() * 1000 + 86_000_000


def test_a_producer_that_exits_right_after_send_leaves_a_confirmed_lock(orphans):
    o = orphans()
    # Given a producer process that sends k and exits at once
    sent = o.produce("send", "kept", "k")
    assert sent.returncode == 0, sent.stderr
    # Then its lock was confirmed before it exited: it lasts lock_ttl, not the window
    [lock] = list(o.admin.locks(phase="queue"))
    assert not lock.holders[0].provisional
    assert lock.holders[0].message_id == json.loads(sent.stdout)["message_id"]
    assert lock.holders[0].deadline > time.time() * 1000 + 86_000_000


def test_a_delayed_message_keeps_its_lock_for_its_delay_plus_lock_ttl(orphans):
    o = orphans()
    app = o.app
    # When a message is sent with a one-hour delay and confirmed
    before = time.time() * 1000
    app.job_kept.send_with_options(args=("k",), delay=3_600_000)
    assert app.unique.flush_confirmations()
    # Then its lock lasts the delay plus lock_ttl
    [lock] = list(o.admin.locks(phase="queue"))
    assert not lock.holders[0].provisional
    assert before + 3_600_000 + 86_399_000 < lock.holders[0].deadline <= time.time() * 1000 + 3_600_000 + 86_400_000


# Reap ---------------------------------------------------------------------


def reap(o: Orphans, *args: str) -> subprocess.CompletedProcess[str]:
    env = {name: value for name, value in os.environ.items() if not name.lower().startswith("dramatiq_unique_")}
    return subprocess.run(
        [sys.executable, "-m", "dramatiq_unique", "reap", "--redis", o.redis_url, "--prefix", o.namespace,
         "--min-age", "0", *args],
        env={**env, "PYTHONPATH": str(ROOT)}, cwd=ROOT, capture_output=True, text=True, timeout=60,
    )


def test_reap_frees_exactly_the_locks_of_messages_gone_from_a_purged_queue(orphans):
    o = orphans()
    app = o.app
    # Given workers on queue "run" that prefetch nothing, one message running there, and one queued behind it
    o.workers(threads=1, dramatiq_queue_prefetch="1")
    running = app.job_run.send("running", gate="go")
    wait_for(lambda: len(o.runs("starts")) == 1, what="the first message to start")
    behind = app.job_run.send("behind")
    # And messages queued and delayed on queues "gone" and "kept", which nobody consumes
    gone = [app.job_gone.send("g1"), app.job_gone.send("g2"),
            app.job_gone.send_with_options(args=("g3",), delay=3_600_000)]
    kept = [app.job_kept.send("k1"), app.job_kept.send_with_options(args=("k2",), delay=3_600_000)]
    assert app.unique.flush_confirmations()
    all_keys = {"running", "behind", "g1", "g2", "g3", "k1", "k2"}
    assert set(o.locked_keys()) == all_keys
    # When queue "gone" (and its delay queue) and queue "run" are purged, while "running" still runs
    app.broker.flush("gone")
    app.broker.flush("run")
    # Then a dry run names exactly the gone messages and the one purged behind the running one
    dry = reap(o)
    assert dry.returncode == 0, dry.stderr
    gone_ids = {m.message_id for m in gone} | {behind.message_id}
    listed = {line.split()[1] for line in dry.stdout.splitlines()[1:] if line.startswith("job_")}
    assert listed == gone_ids, dry.stdout
    assert '{"key":"g1"}' in dry.stdout and "Would release 4 enqueue locks" in dry.stdout
    assert set(o.locked_keys()) == all_keys
    # And --yes releases exactly those, and none of the queued, delayed or running ones
    done = reap(o, "--yes", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert {s["message_id"] for s in report["suspects"] if s["released"]} == gone_ids
    assert o.locked_keys() == {"running": running.message_id, "k1": kept[0].message_id, "k2": kept[1].message_id}
    # And the running message still ends normally and frees its key
    o.open_gate("go")
    wait_for(lambda: len(o.runs()) == 1, what="the running message to end")
    wait_for(lambda: "running" not in o.locked_keys(), what="its lock to be released")
    assert reap(o, "--yes", "--json").returncode == 0
    assert set(o.locked_keys()) == {"k1", "k2"}


def test_reap_leaves_locks_it_cannot_check_and_says_why(orphans, request):
    request.getfixturevalue("rabbitmq_url")
    o = orphans("rabbitmq")
    app = o.app
    # Given a message queued on RabbitMQ, whose queue is then purged
    app.job_kept.send("k1")
    assert app.unique.flush_confirmations()
    app.broker.flush(f"{o.namespace}-kept")
    # Then reap cannot look it up, says so, and leaves its lock
    done = reap(o, "--yes")
    assert done.returncode == 0, done.stderr
    assert "1 with no Redis broker place recorded (RabbitMQ messages cannot be looked up by id" in done.stdout
    assert set(o.locked_keys()) == {"k1"}
    # And release --queue frees the locks of that queue's messages
    released = subprocess.run(
        [sys.executable, "-m", "dramatiq_unique", "release", "--queue", f"{o.namespace}-kept", "--yes",
         "--redis", o.redis_url, "--prefix", o.namespace],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert released.returncode == 0, released.stderr
    assert "Released 1 enqueue lock holder of queue" in released.stdout
    assert o.locked_keys() == {}


def test_the_periodic_reaper_of_two_workers_never_runs_two_passes_at_once(orphans):
    o = orphans(dramatiq_unique_reap_interval="150", ORPHANS_RECORD_PASSES="1")
    app = o.app
    # Given messages on a queue that is then purged, and one that stays queued
    for key in ("g1", "g2", "g3"):
        app.job_gone.send(key)
    app.job_kept.send("k1")
    assert app.unique.flush_confirmations()
    app.broker.flush("gone")
    # When two worker processes run with a periodic reaper every 150 ms
    o.workers(processes=2)
    # Then the gone messages' locks are reaped, and the queued one's is kept
    wait_for(lambda: set(o.locked_keys()) == {"k1"}, timeout=30, what="the periodic reaper to free the gone keys")
    wait_for(lambda: len({p["pid"] for p in o.runs("passes")}) == 2 and len(o.runs("passes")) >= 10, timeout=60,
             what="passes by both worker processes")
    # And no two passes ever overlapped
    passes = sorted(o.runs("passes"), key=lambda p: p["start"])
    overlapping = [(a, b) for a, b in zip(passes, passes[1:]) if b["start"] < a["end"]]
    assert overlapping == []
    assert set(o.locked_keys()) == {"k1"}
