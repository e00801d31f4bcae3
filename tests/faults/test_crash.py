"""Cases 1 and 2: the whole worker group is SIGKILLed while a message
holds its key, and a new group takes over.

Figures: ``recovery_s`` is the time from the SIGKILL to the start of
the next run of the key; ``lost`` counts sent messages that never
completed a run.
"""

from __future__ import annotations

import time

import pytest

from tests.conftest import wait_for
from tests.faults.harness import overlaps, rabbitmq_ready

LEASE_S = 2.0
RESCHEDULE_S = 0.3
#: Fetching a due message takes two polls of 100 ms, plus scheduling
#: noise on a busy machine.
POLLING_S = 0.6


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_a_killed_while_executing_holder_frees_its_key_within_one_lease(make_harness, figure, broker):
    # Given a worker group running a while_executing job for key k, and
    # a Redis broker that declares dead workers after 1 s
    h = make_harness(broker, FAULTS_HEARTBEAT_TIMEOUT="1000")
    first = h.workers(processes=1, threads=2)
    killed = h.app.hold.send("k", gate="killed")
    h.started(killed.message_id)
    # When the whole group is SIGKILLed, the next job for k is sent and a new group starts
    first.kill()
    killed_at = time.time()
    h.open_gate("killed")
    following = h.app.hold.send("k")
    h.workers(processes=1, threads=2)
    # Then the next job runs once the dead holder's lease has run out, and no later
    run = h.finished(following.message_id)
    recovery = run.start - killed_at
    figure("recovery_s", round(recovery, 3))
    assert LEASE_S * 2 / 3 - 0.05 <= recovery <= LEASE_S + RESCHEDULE_S * 1.2 + POLLING_S
    # And the killed message itself is redelivered and runs to its end
    h.finished(killed.message_id)
    if broker == "redis":
        wait_for(lambda: h.queued() == 0, what="the broker to have nothing left in flight")
    else:
        wait_for(lambda: rabbitmq_ready(h.env["FAULTS_RABBITMQ_URL"], h.namespace) == 0, what="an empty queue")
    # And nothing is lost or run twice, and the runs of k never overlapped
    completed = sorted(r.message_id for r in h.runs())
    figure("lost", len({killed.message_id, following.message_id} - set(completed)))
    assert completed == sorted([killed.message_id, following.message_id])
    assert overlaps(h.runs()) == []
    assert [r.message_id for r in h.starts()].count(killed.message_id) == 2


@pytest.mark.parametrize("phase", ["queued", "running"])
@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_a_killed_until_executed_message_reenters_its_own_lock(make_harness, figure, broker, phase):
    # Given an until_executed message that is either running or fetched
    # by a busy single-thread worker that is then SIGKILLed
    h = make_harness(broker, FAULTS_HEARTBEAT_TIMEOUT="1000")
    first = h.workers(processes=1, threads=1)
    if phase == "queued":
        busy = h.app.hold.send("busy", gate="killed")
        h.started(busy.message_id)
    original = h.app.once.send("k", gate="killed")
    if phase == "running":
        h.started(original.message_id)
    elif broker == "redis":
        wait_for(h.fetched, what="the worker to prefetch the message")
    else:
        wait_for(lambda: rabbitmq_ready(h.env["FAULTS_RABBITMQ_URL"], h.namespace) == 0, what="the prefetch")
    first.kill()
    killed_at = time.time()
    # When a duplicate is sent while nobody runs it
    duplicate = h.app.once.send("k")
    # Then it is refused in favour of the original
    assert duplicate.options["unique_duplicate_of"] == original.message_id
    # And when a new group starts, the original re-enters its own lock and runs
    h.workers(processes=1, threads=1)
    rerun = h.started(original.message_id) if phase == "queued" else wait_for_second_start(h, original.message_id)
    figure("recovery_s", round(rerun.start - killed_at, 3))
    assert h.app.once.send("k").options["unique_duplicate_of"] == original.message_id
    h.open_gate("killed")
    h.finished(original.message_id)
    # And after it finished the key is free: the next send is accepted
    wait_for(lambda: h.lock("once", "k", "queue") is None, what="the lock to be released")
    accepted = h.app.once.send("k")
    assert "unique_duplicate_of" not in accepted.options
    h.finished(accepted.message_id)
    runs = [r for r in h.runs() if r.actor == "once"]
    figure("lost", len({original.message_id, accepted.message_id} - {r.message_id for r in runs}))
    assert sorted(r.message_id for r in runs) == sorted([original.message_id, accepted.message_id])


def wait_for_second_start(h, message_id):
    wait_for(lambda: [r.message_id for r in h.starts()].count(message_id) == 2, timeout=30,
             what="the redelivered message to start")
    return [r for r in h.starts() if r.message_id == message_id][-1]
