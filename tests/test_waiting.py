"""Messages waiting for a run lock, as operators see them: in
``LockAdmin.inspect``, ``dramatiq-unique inspect`` and ``locks``, with a
real middleware rescheduling real deliveries.
"""

from __future__ import annotations

import json
import threading
import uuid
from typing import Any, Iterator

import dramatiq
import pytest

from dramatiq_unique import StubBackend, digest_for
from dramatiq_unique.ops.admin import LockAdmin
from tests.conftest import make_worker, unique, wait_for
from tests.test_cli import run


@pytest.fixture(params=["stub", "redis"])
def waiting(request: pytest.FixtureRequest, stub_broker: Any) -> Iterator[tuple[Any, str, list[str]]]:
    """One message of key 1 running, two more rescheduled behind it;
    yields the admin, the digest and the ids of the two waiting ones.
    """
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    backend = StubBackend() if request.param == "stub" else request.getfixturevalue("redis_backend")
    middleware = unique(backend, prefix=prefix, reschedule_delay=60_000)
    stub_broker.add_middleware(middleware)
    gate, started = threading.Event(), threading.Event()

    def sync(account_id: int) -> None:
        started.set()
        gate.wait(30)

    actor = dramatiq.actor(sync, broker=stub_broker, actor_name=f"sync_{uuid.uuid4().hex[:6]}",
                           lock="while_executing")
    first = actor.send(1)
    worker = make_worker(stub_broker, threads=3)
    try:
        assert started.wait(10)
        later = [actor.send(1).message_id for _ in range(2)]
        wait_for(lambda: middleware.events.count("rescheduled") == 2, what="two reschedules")
        yield LockAdmin(backend, prefix=prefix), digest_for(actor, 1), later
    finally:
        gate.set()
        worker.stop()
    assert first.message_id not in later


def test_inspect_lists_the_waiting_messages_first_in_line_first(waiting):
    admin, digest, later = waiting
    [run_lock] = admin.inspect(digest)
    assert run_lock.phase == "run" and len(run_lock.holders) == 1
    # In line by when each was sent (two sends in one millisecond tie).
    assert sorted(w.message_id for w in run_lock.waiting) == sorted(later)
    assert run_lock.waiting[0].order <= run_lock.waiting[1].order
    assert [w["message_id"] for w in run_lock.as_dict()["waiting"]] == [w.message_id for w in run_lock.waiting]


@pytest.mark.parametrize("waiting", ["redis"], indirect=True)
def test_the_command_shows_the_waiting_messages(waiting, redis_url):
    admin, digest, later = waiting
    common = ("--redis", redis_url, "--prefix", admin.prefix)
    text = run("inspect", digest, *common)
    assert text.returncode == 0, text.stderr
    assert "waiting    2" in text.stdout
    lines = [line for line in text.stdout.splitlines() if "  sent " in line]
    assert sorted(line.split()[1] for line in lines) == sorted(later)
    listed = run("locks", *common)
    [row] = [line.split() for line in listed.stdout.splitlines() if digest in line]
    assert row[-1] == "2"
    data = json.loads(run("inspect", digest, *common, "--json").stdout)
    assert sorted(w["message_id"] for w in data[0]["waiting"]) == sorted(later)
