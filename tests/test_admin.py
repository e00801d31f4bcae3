"""The admin API on real locks: what the middleware took, listed,
inspected and released, on the stub backend and on real Redis.
"""

from __future__ import annotations

import threading
import time
import uuid

import dramatiq
import pytest
import redis

from dramatiq_unique import LockBackendError, UniqueMiddleware
from dramatiq_unique.ops.admin import LockAdmin, UnknownLock
from dramatiq_unique.backends.records import Copy
from dramatiq_unique.backends.redis import RedisBackend
from tests.conftest import free_port, make_worker, wait_for

MINUTE = 60_000


def new_prefix() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


def digest(n: int) -> str:
    return f"{n:032x}"


def key(prefix: str, actor: str, n: int, phase: str = "run") -> str:
    return f"{prefix}:{actor}:{{{digest(n)}}}:{phase}"


def take(backend, lock_key: str, owner: str, *, ttl: int = MINUTE, limit: int = 1) -> None:
    assert backend.acquire(lock_key, owner, ttl=ttl, limit=limit, lock="while_executing").acquired


def test_lists_and_inspects_the_enqueue_locks_the_middleware_took(stub_broker, redis_backend, redis_client):
    # Given a middleware on real Redis that records lock args, and an until_executed actor
    prefix = new_prefix()
    unique = UniqueMiddleware(backend=redis_backend, prefix=prefix, record_lock_args=True)
    stub_broker.add_middleware(unique)

    @dramatiq.actor(broker=stub_broker, lock="until_executed", lock_args=["account_id"])
    def sync_account_balance(account_id, requested_at):
        pass

    # When two accounts are sent, and one of them twice, and their publishes are confirmed
    before = time.time() * 1000
    first = sync_account_balance.send(42, 1.0)
    sync_account_balance.send(42, 2.0)
    other = sync_account_balance.send(43, 3.0)
    assert unique.flush_confirmations()
    admin = LockAdmin(redis_backend, prefix=prefix)
    locks = list(admin.locks(actor="sync_account_balance"))

    # Then I expect one enqueue lock per account, held by the first message of each
    assert sorted(lock.key for lock in locks) == sorted(k.decode() for k in redis_client.scan_iter(f"{prefix}:*"))
    assert {lock.holders[0].message_id for lock in locks} == {first.message_id, other.message_id}
    by_id = {lock.holders[0].message_id: lock for lock in locks}
    lock = by_id[first.message_id]
    assert (lock.actor, lock.phase, lock.lock) == ("sync_account_balance", "queue", "until_executed")
    assert lock.as_dict()["lock_args"] == {"account_id": 42}
    assert before + 86_000_000 < lock.holders[0].deadline <= time.time() * 1000 + 86_400_000
    assert not lock.holders[0].provisional and before - 1 <= lock.holders[0].taken_at <= time.time() * 1000
    # And inspecting its digest finds the same lock
    assert admin.inspect(lock.digest) == [lock]


def test_shows_the_run_lock_of_a_running_actor_until_it_ends(stub_broker, redis_backend):
    # Given a while_executing actor that runs until the test lets it go
    prefix = new_prefix()
    stub_broker.add_middleware(UniqueMiddleware(backend=redis_backend, prefix=prefix, lease=MINUTE))
    started, finish = threading.Event(), threading.Event()

    @dramatiq.actor(broker=stub_broker, lock="while_executing")
    def rebuild_index(shard):
        started.set()
        finish.wait(10)

    worker = make_worker(stub_broker, threads=2)
    admin = LockAdmin(redis_backend, prefix=prefix)
    try:
        # When it runs
        message = rebuild_index.send(7)
        assert started.wait(10)
        locks = list(admin.locks(actor="rebuild_index"))

        # Then I expect its run lock, held by the message under a per-run owner
        assert [(lock.phase, lock.lock) for lock in locks] == [("run", "while_executing")]
        (holder,) = locks[0].holders
        assert holder.message_id == message.message_id
        assert holder.owner.startswith(message.message_id + "/")

        # And once it ends, no lock at all
        finish.set()
        wait_for(lambda: not list(admin.locks(actor="rebuild_index")), what="the run lock to be released")
    finally:
        finish.set()
        worker.stop()


def test_filters_by_actor_exactly_and_by_pattern(backend):
    # Given locks of several actors, one with glob characters in its
    # name, one under another prefix, and a lock's waiting list
    prefix = new_prefix()
    take(backend, key(prefix, "billing.sync", 1), "a/1")
    take(backend, key(prefix, "billing.refund", 2, "queue"), "b")
    take(backend, key(prefix, "weird[1]*", 3), "c/1")
    take(backend, key(prefix, "weirdX1YZ", 4), "d/1")
    take(backend, key(f"{prefix}-other", "billing.sync", 5), "e/1")
    backend.join_line(Copy(key(prefix, "billing.sync", 1), "m", 1, "handoff"), b"message", order=1, ttl=MINUTE)
    admin = LockAdmin(backend, prefix=prefix)

    def listed(**filters):
        return sorted(lock.key for lock in admin.locks(**filters))

    # When I filter, then I expect exactly the matching lock keys
    assert listed(actor="weird[1]*") == [key(prefix, "weird[1]*", 3)]
    assert listed(actor="billing.sync") == [key(prefix, "billing.sync", 1)]
    billing = [key(prefix, "billing.refund", 2, "queue"), key(prefix, "billing.sync", 1)]
    assert listed(pattern=f"{prefix}:billing.*") == billing
    assert listed(pattern="*:queue") == [key(prefix, "billing.refund", 2, "queue")]
    assert len(listed()) == 4


def test_inspect_finds_both_locks_of_a_digest_and_drops_expired_holders(backend):
    # Given the enqueue and run locks of one digest, the run lock with a
    # holder that expires at once
    prefix = new_prefix()
    take(backend, key(prefix, "sync", 9, "run"), "m1/n", limit=2)
    take(backend, key(prefix, "sync", 9, "run"), "m2/n", ttl=1, limit=2)
    take(backend, key(prefix, "sync", 9, "queue"), "m1")
    admin = LockAdmin(backend, prefix=prefix)

    # When I inspect it by digest, or by one of its keys
    wait_for(lambda: len(admin.inspect(digest(9))[1].holders) == 1, what="the short holder to expire")
    queue, run = admin.inspect(key(prefix, "sync", 9, "run"))

    # Then I expect the enqueue lock first, and only the live holder
    assert (queue.phase, run.phase) == ("queue", "run")
    assert [h.owner for h in run.holders] == ["m1/n"]
    assert [h.message_id for h in queue.holders] == ["m1"]


def test_inspect_refuses_unknown_and_malformed_digests(backend):
    admin = LockAdmin(backend, prefix=new_prefix())
    with pytest.raises(UnknownLock, match="No lock has digest"):
        admin.inspect(digest(1))
    with pytest.raises(UnknownLock, match="not a digest"):
        admin.inspect("xyz")


def test_release_one_holder_keeps_the_others(backend):
    # Given a run lock with two holders
    prefix = new_prefix()
    lock_key = key(prefix, "sync", 5)
    take(backend, lock_key, "m1/n1", limit=2)
    take(backend, lock_key, "m2/n2", limit=2)
    admin = LockAdmin(backend, prefix=prefix)

    # When I release one holder by its message id
    released = admin.release(digest(5), holder="m1")

    # Then I expect only that holder gone, and it cannot be released twice
    assert released == [f"{lock_key} m1/n1"]
    assert [h.owner for h in admin.inspect(digest(5))[0].holders] == ["m2/n2"]
    with pytest.raises(UnknownLock, match="no holder 'm1'"):
        admin.release(digest(5), holder="m1")
    # And releasing the last holder by its owner string frees the key
    assert admin.release(digest(5), holder="m2/n2") == [f"{lock_key} m2/n2"]
    assert backend.inspect(lock_key) is None


def test_release_digest_deletes_its_locks_but_not_their_waiters(redis_backend, redis_client):
    # Given both locks of a digest, and a message waiting for the run lock
    prefix = new_prefix()
    run_key, queue_key = key(prefix, "sync", 6, "run"), key(prefix, "sync", 6, "queue")
    take(redis_backend, run_key, "m1/n")
    take(redis_backend, queue_key, "m1")
    redis_backend.join_line(Copy(run_key, "m2", 1, "handoff"), b"message", order=1, ttl=MINUTE)
    admin = LockAdmin(redis_backend, prefix=prefix)

    # When I release the run lock only, then the whole digest
    assert admin.release(digest(6), phase="run") == [run_key]
    assert redis_client.exists(queue_key) == 1
    assert admin.release(digest(6)) == [queue_key]

    # Then I expect both keys gone, the waiter's records kept (its
    # delayed copy still needs its record), and nothing left to release
    assert redis_client.exists(run_key, queue_key) == 0
    assert redis_client.exists(f"{run_key}:wait", f"{run_key}:bodies", f"{run_key}:m:m2") == 3
    with pytest.raises(UnknownLock):
        admin.release(digest(6))


def test_release_actor_deletes_every_lock_of_that_actor_only(backend):
    # Given more locks of one actor than one SCAN batch returns, and
    # locks of another actor and of the same actor under another prefix
    prefix = new_prefix()
    mine = {key(prefix, "import_feed", n) for n in range(1500)}
    for lock_key in mine:
        take(backend, lock_key, "m/n")
    take(backend, key(prefix, "import_feed_v2", 1), "m/n")
    take(backend, key(f"{prefix}x", "import_feed", 2), "m/n")
    admin = LockAdmin(backend, prefix=prefix)

    # When I release the actor's locks
    released = admin.release_actor("import_feed")

    # Then I expect each of its locks released once, and the others kept
    assert sorted(released) == sorted(mine)
    assert [lock.actor for lock in admin.locks()] == ["import_feed_v2"]
    assert backend.inspect(key(f"{prefix}x", "import_feed", 2)) is not None


def test_lists_with_scan_and_never_keys(redis_backend, redis_client, redis_url):
    # Given a lock, and a MONITOR of every command the server runs
    prefix = new_prefix()
    take(redis_backend, key(prefix, "sync", 1), "m/n")
    admin = LockAdmin(redis_backend, prefix=prefix)
    db = redis_client.connection_pool.connection_kwargs.get("db", 0)
    marker = f"end-of-{prefix}"
    commands: list[str] = []
    monitor_client = redis.Redis.from_url(redis_url)
    with monitor_client.monitor() as monitor:

        def record():
            for seen in monitor.listen():
                if seen["db"] == db:
                    commands.append(seen["command"].split(" ")[0].upper())
                if marker in seen["command"]:
                    return

        recorder = threading.Thread(target=record, daemon=True)
        recorder.start()
        redis_client.echo("start")
        wait_for(lambda: "ECHO" in commands, what="MONITOR to start")

        # When I list, inspect and release
        assert len(list(admin.locks())) == 1
        admin.inspect(digest(1))
        admin.release_actor("sync")
        redis_client.echo(marker)
        recorder.join(10)
    monitor_client.close()

    # Then I expect SCAN, and no KEYS
    assert "SCAN" in commands
    assert "KEYS" not in commands


def test_an_unreachable_backend_raises_one_line_lock_backend_errors():
    admin = LockAdmin(RedisBackend(url=f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=2), prefix="p")
    for call in (admin.check, lambda: list(admin.locks()), lambda: admin.inspect(digest(1))):
        with pytest.raises(LockBackendError) as caught:
            call()
        assert "\n" not in str(caught.value)
        assert "RedisBackend(redis://127.0.0.1:" in str(caught.value)
